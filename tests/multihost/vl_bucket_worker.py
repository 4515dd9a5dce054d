"""One process of ``test_vl_patch_bucket.py``: packs its own VLM samples (``jaxrl.rl.pack_sequences``), agrees
on the per-row patch bucket with the other process (``jaxrl.rl.agree_patch_bucket``) and builds the global
``pixel_values`` array from both processes' rows.

Run as ``python vl_bucket_worker.py NUM_PROCESSES PROCESS_ID PORT``. Process ``p`` packs one sample whose image
grid is ``GRIDS[p]`` (so the processes' own buckets differ), then, in a second round, process 0 packs a
text-only sample while process 1 keeps its image. The last stdout line is JSON: per round, this process's
bucket before and after, whether its padded arrays equal ``jaxrl.models.batch_vision_inputs`` laid out at the
agreed bucket directly, and the global array's shape.
"""

import json
import sys

from multihost_testlib import configure_process

num_processes, process_id, port = (int(a) for a in sys.argv[1:4])
configure_process(num_processes, process_id, 1, port)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from jaxrl import models, rl, sharding  # noqa: E402

GRIDS = ((1, 4, 4), (1, 8, 12))  # 16 and 96 patches: buckets 16 and 128
VISION = models.ModelConfig.tiny_vl().vision


def sample(grid, rng) -> dict:
  """One rollout sample with (``grid`` not None) or without an image: the keys pack_sequences reads."""
  n = 24 if grid is None else 8 + int(np.prod(grid)) // VISION.spatial_merge_size ** 2
  out = {"tokens": rng.integers(0, 100, n).astype(np.int32), "targets": rng.integers(0, 100, n).astype(np.int32),
         "loss_mask": np.ones(n, np.float32), "rope_positions": np.tile(np.arange(n)[:, None], (1, 3)).astype(np.int32),
         "image_token_mask": np.zeros(n, np.int32)}
  if grid is not None:
    out["pixel_values"] = rng.normal(size=(int(np.prod(grid)), VISION.patch_dim)).astype(np.float32)
    out["grid_thw"] = np.asarray([grid], np.int32)
  return out


def one_round(seqs) -> dict:
  pb = rl.pack_sequences(seqs, row_len=128, rows=1, bucket="exact", vision=VISION)
  before = int(pb.arrays["pixel_values"].shape[2]) if "pixel_values" in pb.arrays else 0
  pb = rl.agree_patch_bucket(pb, VISION)
  after = int(pb.arrays["pixel_values"].shape[2])
  grids = [s["grid_thw"] for s in seqs if "grid_thw" in s]
  pixels = np.zeros((1, after, VISION.patch_dim), np.float32)
  if grids:
    pixels[0, :len(seqs[0]["pixel_values"])] = seqs[0]["pixel_values"]
  want = models.batch_vision_inputs(pixels, np.concatenate(grids) if grids else np.zeros((0, 3), np.int32),
                                    np.zeros(len(grids), np.int32), VISION)
  exact = bool(np.array_equal(pb.arrays["pixel_values"][0], want.pixel_values) and all(
      np.array_equal(pb.arrays[k][0], np.asarray(getattr(want.layout, k))) for k in models.VISION_LAYOUT_KEYS))
  mesh = Mesh(np.asarray(jax.devices()), ("data",))
  local = pb.arrays["pixel_values"].reshape(-1, after, VISION.patch_dim)  # [M·R, P, patch_dim]
  glob = sharding.global_batch(local, NamedSharding(mesh, PartitionSpec("data")))
  return {"before": before, "after": after, "exact": exact, "global_shape": list(glob.shape)}


sharding.initialize()
rng = np.random.default_rng(process_id)
rounds = [one_round([sample(GRIDS[process_id], rng)]),
          one_round([sample(None if process_id == 0 else GRIDS[1], rng)])]
print(json.dumps({"process": jax.process_index(), "rounds": rounds}))
