"""jaxrl: JAX-native LLM post-training (SFT with packing, LoRA, GRPO/PPO family)."""

__version__ = "0.1.0"
