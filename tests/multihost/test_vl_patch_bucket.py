"""Two processes packing their own VLM rollout rows agree on one per-row patch bucket (``rl.agree_patch_bucket``).

Each process packs samples with images of different sizes (own buckets 16 and 128 patches), and in a second
round one process has no image at all; after agreeing, both hold arrays of the larger bucket, equal to the
layout ``models.batch_vision_inputs`` builds at that bucket directly, and the global array across both
processes builds (it cannot from rows of different shapes).
"""

import subprocess
import sys
from pathlib import Path

from multihost_testlib import ROOT, free_port, wait_json, worker_env

WORKER = Path(__file__).with_name("vl_bucket_worker.py")


def test_processes_with_different_image_sizes_agree_on_the_patch_bucket():
  port = free_port()
  procs = [subprocess.Popen([sys.executable, str(WORKER), "2", str(i), str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=worker_env(), cwd=ROOT) for i in range(2)]
  outs = sorted(wait_json(procs, 300), key=lambda o: o["process"])
  first = [o["rounds"][0] for o in outs]
  assert [r["before"] for r in first] == [16, 128]  # the processes' own buckets differ
  assert all(r["after"] == 128 and r["exact"] and r["global_shape"] == [2, 128, 1176] for r in first), first
  second = [o["rounds"][1] for o in outs]
  assert [r["before"] for r in second] == [0, 128]  # process 0 packed no image
  assert all(r["after"] == 128 and r["exact"] and r["global_shape"] == [2, 128, 1176] for r in second), second
