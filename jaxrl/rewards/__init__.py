"""jaxrl.rewards."""
