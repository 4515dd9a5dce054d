"""End to end: `jaxrl serve` of a tiny judge on a loopback port grades every GRPO sample of configs/rar_tiny.yaml."""

from pathlib import Path

import pytest

from jaxrl import config as config_lib
from jaxrl import data, models, rewards, rl, sampling, serve

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "rar_tiny.yaml"


@pytest.mark.slow
def test_rar_tiny_scores_every_sample_over_http(tmp_path):
  cfg_m = models.ModelConfig.tiny(vocab_size=128, hidden_size=32, intermediate_size=64, head_dim=8,
                                  dtype="float32", param_dtype="float32")
  tok = models.load_tokenizer(data.tiny_tokenizer_dir())
  judge_sampler = sampling.Sampler(models.init_model(cfg_m, seed=7), tok, max_len=512)
  app = serve.create_app(judge_sampler, model_name="judge", batch_wait_s=1.0, max_top_logprobs=128)
  with serve.ServerThread(app, port=0) as srv:
    cfg = config_lib.load(rl.RLConfig, CONFIG, [
        f"reward.kwargs.judge.base_url={srv.url}", "reward.kwargs.judge.score_top_logprobs=128", "steps=1", "rollout.prompts_per_step=2", "rollout.n=4",
        "rollout.max_new_tokens=8", "model.overrides.hidden_size=32", "model.overrides.intermediate_size=64",
        f"out_dir={tmp_path / 'run'}", "tensorboard=false"])
    trainer = rl.RLTrainer(cfg)
    trainer.run()
  judge = rewards.get_judge(cfg.reward.kwargs["judge"])
  samples = 2 * 4
  assert judge.stats["requests"] == judge.stats["http_calls"] == samples  # one judge call per sample, no retry
  assert judge.stats["errors"] == 0 and judge.stats["completion_tokens"] == samples
  assert sum(app.state.batcher.batch_sizes) == samples and max(app.state.batcher.batch_sizes) > 1, app.state.batcher.batch_sizes
