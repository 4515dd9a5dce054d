"""jaxrl: JAX-native LLM post-training (SFT with packing, LoRA, GRPO/PPO family)."""

from jaxrl import _platform

# Before JAX is imported: JAX_PLATFORMS=cpu on a machine without accelerators, no CUDA stub notices and
# no PyTorch advice from transformers (jaxrl/_platform.py, docs/platforms.md).
_platform.choose_platform()
_platform.quiet_jax_import()
_platform.quiet_torch_advice()

__version__ = "0.1.0"
