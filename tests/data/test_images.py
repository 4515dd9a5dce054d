"""Image loading and Qwen2-VL preprocessing, against transformers' ``Qwen2VLImageProcessorPil`` (no torch).

Pixel tolerance: 0. Our steps are the processor's steps in the same order and dtypes (PIL bicubic on uint8,
``x * (1/255)`` in float64 rounded to float32, then ``(x - mean) / std`` in float32), so every value is the
same IEEE result; ``assert_array_equal`` holds and the test reports any single-ulp drift.
"""

import base64
import io

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_resize

from jaxrl.data import DataError, ImageConfig, load_image, num_image_tokens, process_image, smart_resize

CFG = ImageConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 64)


@pytest.fixture(scope="module")
def hf():
  return Qwen2VLImageProcessorPil(min_pixels=CFG.min_pixels, max_pixels=CFG.max_pixels)


def _image(h, w, mode="RGB", seed=0):
  rng = np.random.default_rng(seed)
  if mode in ("L", "P"):
    im = Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8), "L")
    return im.convert("P") if mode == "P" else im
  c = {"RGB": 3, "RGBA": 4, "LA": 2}[mode]
  return Image.fromarray(rng.integers(0, 256, (h, w, c), dtype=np.uint8), mode)


def _reference(hf, im):
  out = hf(images=[im], return_tensors="np")
  return out["pixel_values"], tuple(int(x) for x in out["image_grid_thw"][0])


# (height, width): tiny, odd, square, wide, tall, beyond max_pixels, extreme but allowed (ratio 150).
SIZES = [(1, 1), (5, 9), (27, 29), (56, 56), (50, 70), (100, 33), (33, 100), (97, 211), (300, 500),
         (640, 480), (4, 600), (600, 4)]


@pytest.mark.parametrize("size", SIZES)
def test_process_image_equals_transformers(hf, size):
  im = _image(*size, seed=size[0] * 1000 + size[1])
  pixels, grid = process_image(im, CFG)
  ref_pixels, ref_grid = _reference(hf, im)
  assert grid == ref_grid
  assert pixels.dtype == np.float32 and pixels.shape == ref_pixels.shape
  np.testing.assert_array_equal(pixels, ref_pixels)
  assert pixels.shape == (grid[1] * grid[2], CFG.patch_dim)


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "LA"])
def test_process_image_modes_equal_transformers(hf, mode):
  im = _image(45, 83, mode, seed=7)
  pixels, grid = process_image(im, CFG)
  ref_pixels, ref_grid = _reference(hf, im)
  assert grid == ref_grid
  np.testing.assert_array_equal(pixels, ref_pixels)


def test_palette_transparency_is_composited_on_white(hf):
  im = _image(30, 30, "P", seed=3)
  im.info["transparency"] = int(np.asarray(im)[0, 0])
  pixels, _ = process_image(im, CFG)
  np.testing.assert_array_equal(pixels, _reference(hf, im)[0])
  opaque, _ = process_image(Image.fromarray(np.asarray(im.convert("RGB"))), CFG)
  assert not np.array_equal(pixels, opaque)


def test_patch_layout_by_hand():
  """A hand-built 56x56 image: patch k of the (gh/m, gw/m, m, m) order holds its own constant value."""
  cfg = ImageConfig(min_pixels=56 * 56, max_pixels=56 * 56)
  blocks = np.arange(16, dtype=np.uint8).reshape(4, 4) * 10  # one value per 14x14 patch (row, col)
  img = np.repeat(np.repeat(blocks, 14, 0), 14, 1)
  pixels, grid = process_image(Image.fromarray(np.stack([img] * 3, -1)), cfg)
  assert grid == (1, 4, 4)
  order = [(2 * bi + i, 2 * bj + j) for bi in range(2) for bj in range(2) for i in range(2) for j in range(2)]
  for k, (r, c) in enumerate(order):
    value = (np.float32(np.float64(blocks[r, c]) * (1 / 255)) - np.float32(CFG.image_mean[0])) / np.float32(
        CFG.image_std[0])
    np.testing.assert_array_equal(pixels[k, :2 * 196], value)  # channel 0, both temporal copies


def test_smart_resize_matches_transformers_and_bounds():
  rng = np.random.default_rng(0)
  for h, w in rng.integers(1, 3000, (300, 2)):
    if max(h, w) / min(h, w) > 200:
      continue
    got = smart_resize(int(h), int(w), factor=28, min_pixels=3136, max_pixels=200_704)
    assert got == hf_resize(int(h), int(w), factor=28, min_pixels=3136, max_pixels=200_704)
    assert got[0] % 28 == 0 and got[1] % 28 == 0


def test_extreme_aspect_ratio_is_refused_naming_the_image(hf):
  im = _image(2, 500)
  with pytest.raises(ValueError, match="aspect ratio"):
    _reference(hf, im)
  with pytest.raises(DataError, match=r"^data\.jsonl:3: messages\[0\]\.content\[1\]: image aspect ratio 250"):
    process_image(im, CFG, where="data.jsonl:3: messages[0].content[1]")


def test_num_image_tokens():
  assert num_image_tokens((1, 4, 6), 2) == 6
  assert num_image_tokens(np.array([2, 8, 8]), 2) == 32


def _png(im):
  buf = io.BytesIO()
  im.save(buf, "PNG")
  return buf.getvalue()


def test_load_image_path_bytes_data_url_agree(tmp_path):
  im = _image(20, 30, "RGBA", seed=5)
  data = _png(im)
  (tmp_path / "a.png").write_bytes(data)
  url = "data:image/png;base64," + base64.b64encode(data).decode()
  loaded = [load_image(s, where="w") for s in (str(tmp_path / "a.png"), data, url, {"bytes": data, "path": None},
                                                f"file://{tmp_path / 'a.png'}")]
  loaded.append(load_image("a.png", where="w", root=tmp_path))
  for got in loaded:
    assert got.mode == "RGBA"
    np.testing.assert_array_equal(np.asarray(got), np.asarray(im))


def test_load_image_applies_exif_orientation():
  im = _image(10, 20, seed=1)
  exif = Image.Exif()
  exif[0x0112] = 6  # rotate 90 degrees clockwise on display
  buf = io.BytesIO()
  im.save(buf, "PNG", exif=exif)
  got = load_image(buf.getvalue(), where="w")
  assert got.size == (10, 20)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(im.transpose(Image.Transpose.ROTATE_270)))


def test_load_image_errors_name_where(tmp_path):
  with pytest.raises(DataError, match=r"^d\.jsonl:4: messages\[1\]: image file not found: .*nope\.png") as e:
    load_image(str(tmp_path / "nope.png"), where="d.jsonl:4: messages[1]")
  assert e.value.reason == "missing image"
  (tmp_path / "bad.png").write_bytes(b"not an image")
  with pytest.raises(DataError, match=r"^d\.jsonl:5: x: cannot read image .*bad\.png") as e:
    load_image(str(tmp_path / "bad.png"), where="d.jsonl:5: x")
  assert e.value.reason == "unreadable image"
  with pytest.raises(DataError, match=r"^w: the data URL's base64 payload does not decode"):
    load_image("data:image/png;base64,@@@", where="w")
  with pytest.raises(DataError, match="no network"):
    load_image("https://example.com/a.png", where="w")
  big = _png(_image(40, 50))
  with pytest.raises(DataError, match=r"^w: image \d+ bytes has 50x40 = 2000 pixels, more than") as e:
    load_image(big, where="w", max_source_pixels=1999)
  assert e.value.reason == "oversized image"
  assert load_image(big, where="w", max_source_pixels=2000).size == (50, 40)


def test_image_config_from_hf(tmp_path):
  (tmp_path / "preprocessor_config.json").write_text(
      '{"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}')
  cfg = ImageConfig.from_hf(tmp_path, max_pixels=200_704)
  assert (cfg.min_pixels, cfg.max_pixels, cfg.patch_dim) == (3136, 200_704, 1176)
  (tmp_path / "preprocessor_config.json").write_text('{"size": {"shortest_edge": 100, "longest_edge": 5000}}')
  assert (ImageConfig.from_hf(tmp_path).min_pixels, ImageConfig.from_hf(tmp_path).max_pixels) == (100, 5000)
  with pytest.raises(ValueError, match="min_pixels"):
    ImageConfig(min_pixels=10, max_pixels=5)
