"""jaxrl.rl."""
