"""``log_samples``: each step's first samples in ``out_dir/samples.jsonl``, equal to the rollout the update used."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from jaxrl import data, models
from jaxrl.rl import RLTrainer
from jaxrl.rl._rollout import sample_records

from rl_testlib import make_config


def test_each_step_writes_its_first_samples_as_the_update_saw_them(tmp_path):
  trainer = RLTrainer(make_config(tmp_path, log_samples=3, steps=2))
  try:
    trainer.run()
  finally:
    trainer.close()
  rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text("utf-8").splitlines()]
  assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
  last = trainer.last_rollout  # step 2's
  for i, r in enumerate(rows[3:]):
    assert r["completion"] == last.texts[i] and r["length"] == last.lengths[i]
    assert r["reward"] == pytest.approx(float(last.rewards[i])) and r["group"] == last.group_ids[i]
    assert r["prompt"] == trainer.tokenizer.decode(list(last.prompt_ids[i]), skip_special_tokens=False)
    assert r["truncated"] == bool(last.truncated[i])
  with pytest.raises(ValueError, match="log_samples must be an int >= 0"):
    make_config(tmp_path, log_samples=-1)


def test_an_images_placeholder_run_is_written_once_with_its_count():
  tok = models.load_tokenizer(data.tiny_vl_tokenizer_dir())
  pad, start, end = (tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
  ids = np.asarray(tok.encode("What colour?", add_special_tokens=False) + [start] + [pad] * 4 + [end], np.int32)
  rollout = types.SimpleNamespace(num_samples=2, prompt_ids=(ids, ids), group_ids=np.asarray([0, 0]),
                                  texts=("Answer: red", "Answer: blue"), rewards=np.asarray([1.0, 0.0]),
                                  task_rewards=np.asarray([1.0, 0.0]), lengths=np.asarray([11, 12]),
                                  truncated=np.asarray([False, True]))
  rows = sample_records(rollout, tok, step=7, limit=5)
  assert len(rows) == 2 and rows[1]["truncated"] is True and rows[0]["step"] == 7
  assert rows[0]["prompt"].endswith("<|vision_start|><|image_pad|>×4<|vision_end|>")
