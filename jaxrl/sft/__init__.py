"""jaxrl.sft."""
