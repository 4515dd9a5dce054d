"""Tiny local HF model directories (the committed character tokenizer, random weights) for serve/judge tests."""

from pathlib import Path

from jaxrl import data, models


def make_tiny_hf(out_dir: Path, *, seed: int = 0) -> Path:
  """Writes a random 2-layer model with the tiny chat tokenizer to ``out_dir`` (no network)."""
  cfg = models.ModelConfig.tiny(vocab_size=128, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                                head_dim=8, dtype="float32", param_dtype="float32")
  model = models.init_model(cfg, seed=seed)
  models.save_pretrained(model, out_dir, tokenizer=models.load_tokenizer(data.tiny_tokenizer_dir()))
  return Path(out_dir)
