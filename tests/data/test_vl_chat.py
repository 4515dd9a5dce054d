"""Chat records with images -> tokens, loss masks, patches and grids.

References: the committed fixtures' ``reference.npz`` (prompt input ids, pixel values and grids that the fixture
script built with transformers' chat template, tokenizer and image processor). For training records: the fixture
template's rendering of the part-list messages (text equality), the text path's tokens (``encode_chat``, which
tokenises template pieces one by one, so a whole-text tokenisation is not the reference for a tokenizer that
prepends a space to each piece, as the fixture's does) and the t*h*w/4 run lengths.
``Qwen2_5_VLProcessor`` / ``Qwen2VLProcessor`` themselves run without torch once their constructor's class-name
check of the (absent, torch-only) video processor is skipped; ``test_prompts_equal_transformers_processor`` does
that (monkeypatched for that test only) and compares ids, pixels and grids with the real processor.
"""

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

from jaxrl.data import (DataError, ImageConfig, encode_chat, encode_vl_prompt, encode_vl_record, flatten_vl_messages,
                        process_image, tiny_tokenizer_dir, vl_record_messages)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
CFG = ImageConfig(min_pixels=3136, max_pixels=50176)


def _png(arr):
  buf = io.BytesIO()
  Image.fromarray(arr).save(buf, "PNG")
  return buf.getvalue()


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def fixture(request):
  d = FIXTURES / request.param
  vision = np.load(d / "vision.npz")
  images = [vision[f"images_{k}"] for k in range(3)]
  return AutoTokenizer.from_pretrained(d), images, dict(np.load(d / "reference.npz"))


def _img(src):
  return {"type": "image", "image": src}


def _txt(s):
  return {"type": "text", "text": s}


def test_prompts_equal_the_fixture_batch(fixture):
  tok, images, ref = fixture
  png = [_png(im) for im in images]
  url = "data:image/png;base64," + base64.b64encode(png[1]).decode()
  prompts = [
      {"messages": [{"role": "user", "content": [_img(png[0]), _txt("Compare the two pictures."), _img(png[2])]}]},
      {"messages": [{"role": "user", "content": "How many objects are there?"},
                    {"role": "assistant", "content": "There are three."},
                    {"role": "user", "content": [_txt("Describe the picture."),
                                                 {"type": "image_url", "image_url": {"url": url}}]}]},
      {"prompt": "What colour is the square?"},
  ]
  outs = [encode_vl_prompt(tok, p, images=CFG) for p in prompts]
  for b, out in enumerate(outs):
    row = ref["input_ids"][b][ref["attention_mask"][b].astype(bool)]
    np.testing.assert_array_equal(out["tokens"], row)
  np.testing.assert_array_equal(np.concatenate([o["grid_thw"] for o in outs]), ref["image_grid_thw"])
  np.testing.assert_array_equal(np.concatenate([o["pixel_values"] for o in outs]), ref["pixel_values"])


def test_prompts_equal_transformers_processor(fixture, monkeypatch):
  tok, images, _ = fixture
  # the constructor checks every argument's class; the video processor's needs torch, and we pass none
  monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
  cls = Qwen2_5_VLProcessor if "qwen2_5" in tok.name_or_path else Qwen2VLProcessor
  proc = cls(image_processor=Qwen2VLImageProcessorPil(min_pixels=CFG.min_pixels, max_pixels=CFG.max_pixels),
             tokenizer=tok, video_processor=None, chat_template=tok.chat_template)
  ims = [Image.fromarray(im) for im in images] + [Image.fromarray(images[1][:, :41].repeat(8, 0))]  # + 240x41
  conversations = [
      [{"role": "user", "content": [_img(ims[0]), _txt("Compare"), _img(ims[1])]}],
      [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [_img(ims[2]), _txt("What?")]},
       {"role": "assistant", "content": "A thing."},
       {"role": "user", "content": [_txt("And"), _img(ims[3]), _img(ims[0])]}],
      [{"role": "user", "content": "text only"}],
  ]
  for conv in conversations:
    text = proc.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    pil = [p["image"] for m in conv if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]
    ref = proc(text=[text], images=pil or None, return_tensors="np")
    ours = [{**m, "content": [{**p, "image": _png(np.asarray(p["image"]))} if p["type"] == "image" else p
                              for p in m["content"]]} if isinstance(m["content"], list) else m for m in conv]
    out = encode_vl_prompt(tok, {"messages": ours}, images=CFG)
    np.testing.assert_array_equal(out["tokens"], ref["input_ids"][0])
    if pil:
      np.testing.assert_array_equal(out["grid_thw"], ref["image_grid_thw"])
      np.testing.assert_array_equal(out["pixel_values"], ref["pixel_values"])


def _collapse(tokens, pad):
  """Each run of image-pad tokens back to one token, with the run lengths."""
  out, runs = [], []
  for t in tokens.tolist():
    if t == pad and out and out[-1] == pad:
      runs[-1] += 1
      continue
    out.append(t)
    if t == pad:
      runs.append(1)
  return np.asarray(out), runs


def test_training_record_tokens_masks_and_images(fixture, tmp_path):
  tok, images, _ = fixture
  for k, im in enumerate(images):
    Image.fromarray(im).save(tmp_path / f"{k}.png")
  messages = [
      {"role": "user", "content": [_img(str(tmp_path / "0.png")), _img("1.png"), _txt("What changed?")]},
      {"role": "assistant", "content": "The colours."},
      {"role": "user", "content": [_txt("And here?"), {"type": "image_url", "image_url": {"url": "2.png"}}]},
      {"role": "assistant", "content": "The same."},
  ]
  out = encode_vl_record(tok, {"messages": messages, "_where": "d.jsonl:1", "_index": 4}, images=CFG,
                         image_root=tmp_path)
  grids = [process_image(Image.fromarray(im), CFG)[1] for im in images]
  np.testing.assert_array_equal(out["grid_thw"], grids)
  expect_pixels = np.concatenate([process_image(Image.fromarray(im), CFG)[0] for im in images])
  np.testing.assert_array_equal(out["pixel_values"], expect_pixels)
  # the fixture's own template renders the part lists exactly as our flattened strings
  template_messages = [{**m, "content": [p if p["type"] == "text" else {"type": "image", "image": "x"}
                                         for p in m["content"]]} if isinstance(m["content"], list) else m
                       for m in messages]
  flat, _ = flatten_vl_messages(messages)
  assert tok.apply_chat_template(flat, tokenize=False) == tok.apply_chat_template(template_messages, tokenize=False)
  # the expansion: every image is one pad token in the text path, repeated t*h*w/4 times here
  pad = tok.convert_tokens_to_ids("<|image_pad|>")
  collapsed, runs = _collapse(out["tokens"], pad)
  np.testing.assert_array_equal(collapsed, encode_chat(tok, flat)["tokens"])
  assert runs == [int(np.prod(g)) // 4 for g in grids]
  trained = {int(t): tok.decode(out["tokens"][out["turn_id"] == t]) for t in set(out["turn_id"].tolist()) if t}
  assert trained == {1: "The colours.<|im_end|>", 2: "The same.<|im_end|>"}
  np.testing.assert_array_equal(out["loss_mask"], out["turn_id"] > 0)
  assert set(out["sample_id"].tolist()) == {4}
  first = encode_vl_prompt(tok, {"messages": messages[:2]}, images=CFG, image_root=tmp_path)
  np.testing.assert_array_equal(out["tokens"][:len(first["tokens"])], first["tokens"])  # the prompt is a prefix
  np.testing.assert_array_equal(first["grid_thw"], grids[:2])
  assert len(encode_vl_prompt(tok, {"messages": messages}, images=CFG, image_root=tmp_path)["grid_thw"]) == 3


def test_image_in_an_assistant_turn_is_never_trained(fixture):
  tok, images, _ = fixture
  messages = [{"role": "user", "content": "Draw it."},
              {"role": "assistant", "content": [_txt("Here:"), _img(_png(images[2])), _txt("done")]}]
  out = encode_vl_record(tok, {"messages": messages}, images=CFG)
  pad = out["tokens"] == tok.convert_tokens_to_ids("<|image_pad|>")
  assert pad.sum() == 4 and not out["loss_mask"][pad].any() and not out["turn_id"][pad].any()
  text = encode_chat(tok, flatten_vl_messages(messages)[0])
  keep = text["loss_mask"] & (text["tokens"] != tok.convert_tokens_to_ids("<|image_pad|>"))
  np.testing.assert_array_equal(out["tokens"][out["loss_mask"]], text["tokens"][keep])
  assert out["loss_mask"].sum() == text["loss_mask"].sum() - 1


def test_text_only_record_has_no_images(fixture):
  tok, _, _ = fixture
  out = encode_vl_record(tok, {"prompt": "Hi", "completion": "Hello"}, images=CFG)
  assert out["pixel_values"].shape == (0, CFG.patch_dim) and out["grid_thw"].shape == (0, 3)


def test_errors_name_file_line_and_part(fixture, tmp_path):
  tok, images, _ = fixture

  def encode(content, **kw):
    rec = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}],
           "_where": "data.jsonl:7"}
    return encode_vl_record(tok, rec, images=kw.pop("images", CFG), image_root=tmp_path)

  with pytest.raises(DataError, match=r"^data\.jsonl:7: messages\[0\]\.content\[1\]: image file not found") as e:
    encode([_txt("a"), _img("missing.png")])
  assert e.value.reason == "missing image"
  (tmp_path / "bad.png").write_bytes(b"\x89PNG broken")
  with pytest.raises(DataError, match=r"^data\.jsonl:7: messages\[0\]\.content\[0\]: cannot read image") as e:
    encode([_img("bad.png")])
  assert e.value.reason == "unreadable image"
  with pytest.raises(DataError, match=r"^data\.jsonl:7: messages\[0\]\.content\[0\]: image .* more than") as e:
    encode([_img(_png(images[0]))], images=ImageConfig(min_pixels=3136, max_pixels=50176, max_source_pixels=100))
  assert e.value.reason == "oversized image"
  with pytest.raises(DataError, match=r"^data\.jsonl:7: messages\[0\]\.content\[0\]: image aspect ratio"):
    encode([_img(_png(np.zeros((1, 300, 3), np.uint8)))])
  with pytest.raises(DataError, match=r"^data\.jsonl:7: messages\[0\]\.content\[1\]: a content part needs 'type'"):
    encode([_txt("a"), {"type": "audio"}])
  with pytest.raises(DataError, match=r"^data\.jsonl:7: messages\[0\]\.content\[0\]: text holds the marker"):
    encode([_txt("look <|image_pad|>")])
  with pytest.raises(DataError, match=r"^data\.jsonl:7: .*no trained assistant turn"):
    encode_vl_record(tok, {"messages": [{"role": "user", "content": [_txt("a")]}], "_where": "data.jsonl:7"})


def test_tokenizer_without_vision_tokens_is_refused():
  tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
  with pytest.raises(DataError, match="no <|vision_start|> token"):
    encode_vl_record(tok, {"prompt": "a", "completion": "b"})


def test_flatten_keeps_order_and_string_messages():
  flat, images = flatten_vl_messages(
      [{"role": "system", "content": "s"},
       {"role": "user", "content": [_img("a"), _txt("x"), _img("b")]},
       {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "c"}}]}], where="f:1")
  assert [m["content"] for m in flat] == [
      "s", "<|vision_start|><|image_pad|><|vision_end|>x<|vision_start|><|image_pad|><|vision_end|>",
      "<|vision_start|><|image_pad|><|vision_end|>"]
  assert images == [("a", "f:1: messages[1].content[0]"), ("b", "f:1: messages[1].content[2]"),
                    ("c", "f:1: messages[2].content[0]")]


def test_vl_record_messages_validates_without_loading_images():
  rec = {"messages": [{"role": "user", "content": [_img("not/loaded.png"), _txt("q")]},
                      {"role": "assistant", "content": "a"}]}
  messages, images = vl_record_messages(rec, where="f:2")
  assert messages[0]["content"] == "<|vision_start|><|image_pad|><|vision_end|>q"
  assert images == [("not/loaded.png", "f:2: messages[0].content[0]")]
  with pytest.raises(DataError, match="no trained assistant turn"):
    vl_record_messages({"messages": rec["messages"][:1]})
  with pytest.raises(DataError, match=r"^f:2: messages\[0\]\.content\[0\]: an image part needs an 'image'"):
    vl_record_messages({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, where="f:2")


def test_top_level_images_trl_and_verl_layouts(fixture):
  tok, images, _ = fixture
  png = [_png(im) for im in images]
  inline = {"messages": [{"role": "user", "content": [_img(png[0]), _txt("Compare "), _img(png[2]), _txt("now.")]},
                         {"role": "assistant", "content": "Same."}]}
  trl = {"images": [png[0], png[2]],
         "messages": [{"role": "user", "content": [{"type": "image"}, _txt("Compare "), {"type": "image"},
                                                   _txt("now.")]},
                      {"role": "assistant", "content": "Same."}]}
  verl = {"images": [png[0], png[2]], "prompt": "<image>Compare <image>now.", "completion": "Same."}
  want = encode_vl_record(tok, inline, images=CFG)
  for rec in (trl, verl):
    got = encode_vl_record(tok, rec, images=CFG)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
  np.testing.assert_array_equal(encode_vl_prompt(tok, verl, images=CFG)["tokens"],
                                encode_vl_prompt(tok, inline, images=CFG)["tokens"])
  with pytest.raises(DataError, match=r"^f:3: the record lists 3 images but its messages place 2"):
    encode_vl_record(tok, {**verl, "images": png, "_where": "f:3"}, images=CFG)
  with pytest.raises(DataError, match=r"^f:3: messages\[0\]\.content \(images\[1\]\): image file not found"):
    encode_vl_record(tok, {**verl, "images": [png[0], "gone.png"], "_where": "f:3"}, images=CFG)
  with pytest.raises(DataError, match=r"messages\[0\]\.content\[2\]: an image without its own source"):
    encode_vl_record(tok, {**trl, "images": [png[0]]}, images=CFG)
  plain = encode_vl_record(tok, {"prompt": "a <image> tag", "completion": "b"}, images=CFG)  # no list: text
  assert len(plain["grid_thw"]) == 0
