"""jaxrl.data."""
