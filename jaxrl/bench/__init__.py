"""jaxrl.bench."""
