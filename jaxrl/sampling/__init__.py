"""jaxrl.sampling."""
