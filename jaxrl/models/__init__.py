"""jaxrl.models."""
