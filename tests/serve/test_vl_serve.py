"""`jaxrl serve` with a vision-language model, through the official `openai` client: chat ``image_url`` parts
(data URLs and local files) give exactly the sampler's completion of the same prompt encoded by
:func:`jaxrl.data.encode_vl_prompt`; remote URLs, unreadable files and images for a text model are 400s."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from jaxrl import data, models, sampling, serve

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "qwen2_5_vl"
IMAGES = data.ImageConfig(min_pixels=3136, max_pixels=50176)  # the fixture processor's


@pytest.fixture(scope="module")
def vl_sampler():
  model = models.load_pretrained(FIXTURE, dtype="float32")
  return sampling.Sampler(model, models.load_tokenizer(FIXTURE), max_len=128, eos_token_ids=[])


@pytest.fixture(scope="module")
def vl_client(vl_sampler):
  app = serve.create_app(vl_sampler, model_name="vl", image_config=IMAGES)
  with serve.ServerThread(app, port=0) as srv:
    yield openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def png(tmp_path_factory) -> Path:
  path = tmp_path_factory.mktemp("images") / "shape.png"
  Image.fromarray(np.load(FIXTURE.parent / "qwen2_5_vl" / "vision.npz")["images_0"]).save(path)
  return path


def _data_url(path: Path) -> str:
  buf = io.BytesIO(path.read_bytes())
  return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(url: str) -> list[dict]:
  return [{"role": "user", "content": [{"type": "text", "text": "what is in"},
                                       {"type": "image_url", "image_url": {"url": url}},
                                       {"type": "text", "text": "this picture?"}]}]


def test_image_url_parts_give_the_samplers_completion(vl_sampler, vl_client, png):
  want = data.encode_vl_prompt(vl_sampler.tokenizer, {"messages": _messages(str(png))}, images=IMAGES)
  assert len(want["grid_thw"]) == 1
  ref = vl_sampler.generate([want], max_new_tokens=6, temperature=0.0)
  for url in (_data_url(png), str(png), png.as_uri()):
    got = vl_client.chat.completions.create(model="vl", messages=_messages(url), max_tokens=6, temperature=0,
                                            logprobs=True)
    assert got.choices[0].message.content == ref.texts[0]
    assert got.usage.prompt_tokens == len(want["tokens"]) and got.usage.completion_tokens == 6
    np.testing.assert_allclose([t.logprob for t in got.choices[0].logprobs.content], ref.logprobs[0], atol=1e-5)


def test_image_refusals_are_400s_naming_the_part(vl_client, client, tmp_path, png):
  with pytest.raises(openai.BadRequestError, match="remote image URLs are not fetched") as e:
    vl_client.chat.completions.create(model="vl", messages=_messages("https://example.com/cat.png"), max_tokens=2)
  assert e.value.body["param"] == "messages.[0].content.[1].image_url"
  bad = tmp_path / "broken.png"
  bad.write_bytes(b"not an image")
  with pytest.raises(openai.BadRequestError, match="broken.png") as e:
    vl_client.chat.completions.create(model="vl", messages=_messages(str(bad)), max_tokens=2)
  assert e.value.body["param"] == "messages"
  with pytest.raises(openai.BadRequestError, match="no vision tower"):  # conftest's text model
    client.chat.completions.create(model="tiny", messages=_messages(_data_url(png)), max_tokens=2)
