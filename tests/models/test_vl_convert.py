"""``jaxrl convert`` on a VLM checkpoint keeps its processor files (``preprocessor_config.json``, ...)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from jaxrl import data as data_lib
from jaxrl.cli import convert

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "qwen2_5_vl"


def test_convert_copies_the_processor_files(tmp_path, capsys):
  src = tmp_path / "src"
  shutil.copytree(FIXTURE, src)
  processor = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 200704,
               "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
               "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
  (src / "preprocessor_config.json").write_text(json.dumps(processor))
  (src / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
  assert convert.main([str(src), str(tmp_path / "dst")]) == 0
  assert "copied preprocessor_config.json, chat_template.json from the source" in capsys.readouterr().out
  for name in ("preprocessor_config.json", "chat_template.json"):
    assert (tmp_path / "dst" / name).read_bytes() == (src / name).read_bytes()
  assert data_lib.ImageConfig.from_hf(tmp_path / "dst") == data_lib.ImageConfig.from_hf(src)
  assert data_lib.ImageConfig.from_hf(tmp_path / "dst").max_pixels == 200704
  assert convert.main([str(FIXTURE), str(tmp_path / "plain")]) == 0  # nothing to copy: nothing copied
  assert "copied" not in capsys.readouterr().out
  assert not (tmp_path / "plain" / "preprocessor_config.json").exists()
