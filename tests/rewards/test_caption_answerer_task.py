"""SFT data for CapRL's text answerer on the caption task: prompts as caprl_reward builds them, replies as the
exact caption reader gives them, captions with a sampled captioner's mistakes, held-out scenes kept apart."""

import collections
import re

import numpy as np
import pytest

from jaxrl import data as data_lib
from jaxrl import rewards

TEMPLATE = "Description:\n{caption}\n\nQuestion: {question}\nOptions:\n{options}\n\nAnswer:"


def _task(**kw):
  base = dict(n_train=400, n_heldout=64, scenes=200, difficulty=0, image_size=56, max_objects=1, shape_scale=3.0,
              seed=3, answerer=rewards.CapRLConfig(template=TEMPLATE, unanswerable="Cannot be answered."))
  return rewards.CaptionAnswerTask(**{**base, **kw})


def test_a_record_is_caprls_prompt_and_the_readers_letter():
  recs = _task().records("train")
  assert len(recs) == 400
  for r in recs[:50]:
    user, reply = r["messages"]
    m = re.fullmatch(r"Description:\n(.*)\n\nQuestion: (.*)\nOptions:\n(.*)\n\nAnswer:", user["content"], re.S)
    assert m and m.group(1) == r["caption"] and m.group(2) == r["question"]
    options = dict(re.findall(r"^([A-Z])\. (.*)$", m.group(3), re.M))
    assert "Cannot be answered." in options.values()
    # The letter by hand: the option whose text is the caption's answer, else "cannot be answered".
    said = rewards.caption_answer(r["caption"], r["question"])
    want = next((k for k, v in options.items() if v == said), None) or \
        next(k for k, v in options.items() if "cannot be answered" in v.lower())
    asked = re.search(r"How many (\w+?)s? (?:shapes )?are|Is the (\w+ \w+) on", r["question"])
    assert reply == {"role": "assistant", "content": f" {asked.group(1) or asked.group(2)} {said or 'none'} {want}"}
    assert r["letter"] == want
    assert rewards.first_option_letter(reply["content"], len(options)) == want  # what caprl_reward reads


def test_captions_carry_a_samplers_mistakes_and_every_reply_letter_occurs():
  recs = _task(n_train=2000).records("train")
  reference = {r["caption"] for r in data_lib.generate_caption_task(200, seed=3, split="train",
                                                                     config=_task().task)}
  clean = np.mean([r["caption"] in reference for r in recs])
  assert 0.3 < clean < 0.6, clean  # 40 % unchanged, and some mistakes leave it unchanged too
  letters = collections.Counter(r["letter"] for r in recs)
  assert set(letters) == {"A", "B", "C"} and min(letters.values()) > 400
  cannot = sum(rewards.caption_answer(r["caption"], r["question"]) is None for r in recs)
  assert 0.1 < cannot / len(recs) < 0.5


def test_perturbations_are_seeded_and_varied():
  caption = "1 shape: red triangle left."
  a = [rewards.perturb_caption(caption, np.random.default_rng(i)) for i in range(200)]
  b = [rewards.perturb_caption(caption, np.random.default_rng(i)) for i in range(200)]
  assert a == b and len(set(a)) > 60 and a.count(caption) > 60 and "" in a


def test_the_prompt_is_the_one_caprl_reward_sends():
  t = _task()
  rec = t.records("heldout")[0]
  assert len(t.records("heldout")) == 64 and t.records("heldout") == t.records("heldout")
  assert [r["messages"] for r in t.records("heldout")] != [r["messages"] for r in t.records("train")[:64]]
  sent = []
  scene_q = next(q for c in data_lib.generate_caption_task(t.scenes, seed=t.seed, split="heldout", config=t.task)
                 for q in c["questions"] if q["question"] == rec["question"])
  rewards.caprl_reward("p", rec["caption"], questions=[scene_q], config=t.answerer,
                       answerer=lambda messages, **_: sent.append(messages[-1]["content"]) or "A")
  strip = lambda text: re.sub(r"Options:\n.*\n\n", "Options:\n\n", text, flags=re.S)  # noqa: E731
  assert len(sent) == 4 and {strip(x) for x in sent} == {strip(rec["messages"][0]["content"])}
  # and the record's option order is one of the orders the reward shows (a shuffle of the same options)
  shown = {tuple(sorted(re.findall(r"^[A-Z]\. (.*)$", x, re.M))) for x in sent}
  assert shown == {tuple(sorted(re.findall(r"^[A-Z]\. (.*)$", rec["messages"][0]["content"], re.M)))}


def test_bad_section_values_name_the_key():
  with pytest.raises(ValueError, match="data.caption_answer_task.scenes"):
    _task(scenes=0)
  with pytest.raises(ValueError, match="data.caption_answer_task"):
    _task(max_objects=0)


def test_answerer_tokenizer_is_word_level_and_the_committed_asset(tmp_path):
  import json

  from transformers import AutoTokenizer

  rewards.build_caption_answerer_tokenizer(tmp_path)
  committed = rewards.caption_answerer_tokenizer_dir()
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    assert (tmp_path / name).read_text() == (committed / name).read_text(), name
  tok = AutoTokenizer.from_pretrained(str(committed))
  prompt = TEMPLATE.format(caption="1 shape: blue circle left.", question="How many circles are in the image?",
                           options="A. 1\nB. Cannot be answered.\nC. 0")
  ids = tok(prompt, add_special_tokens=False)["input_ids"]
  assert tok.decode(ids) == prompt and tok.unk_token_id not in ids and len(ids) < len(prompt) / 2
  garbled = tok(" red cirsle", add_special_tokens=False)["input_ids"]
  assert tok.convert_ids_to_tokens(garbled) == [" red", "<|unk|>"]
  reply = tok("left A", add_special_tokens=False)["input_ids"]
  assert tok.convert_ids_to_tokens(reply) == ["left", " A"] and tok.decode(reply) == "left A"
  assert json.loads((committed / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"
