"""The vision-language RL data builders with scripted endpoints: CapRL's QA curation thresholds, RubiCap's
rubric synthesis (consensus, failures only, malformed answers), Vision-R1's modality-bridging cold start,
and the three commands end to end against a fake OpenAI-compatible server."""

import json
import re
from collections import Counter

import pytest
from fastapi import FastAPI, Request

from jaxrl import data as data_lib
from jaxrl import eval as eval_lib
from jaxrl import serve
from jaxrl.cli import main as cli_main


PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def images(tmp_path, *names):
  for n in names:
    (tmp_path / n).write_bytes(PNG)


def shown(messages):
  content = messages[-1]["content"]
  text = content if isinstance(content, str) else content[-1]["text"]
  return re.findall(r"^([A-Z])\. (.*)$", text, flags=re.M), re.search(r"Question: (.*)", text).group(1)


class Scripted:
  """Answers question Q correctly on its first ``right[Q]`` calls and wrongly after (letter of another option)."""

  def __init__(self, right, truth):
    self.right, self.truth, self.calls, self.images = right, truth, Counter(), []

  def __call__(self, messages, **_):
    content = messages[-1]["content"]
    self.images.append(not isinstance(content, str) and content[0]["type"] == "image_url"
                       and content[0]["image_url"]["url"].startswith("data:image/png;base64,"))
    opts, q = shown(messages)
    self.calls[q] += 1
    good = next(l for l, t in opts if t == self.truth[q])
    bad = next(l for l, t in opts if t != self.truth[q])
    return f"Answer: {good if self.calls[q] <= self.right[q] else bad}"


def q(text, truth):
  return {"question": text, "options": ["red", "blue", "green", "white"], "answer": "ABCD"["red blue green white".split().index(truth)]}


def test_caprl_curation_thresholds_are_strict(tmp_path):
  images(tmp_path, "a.png", "b.png")
  rows = [{"image": "a.png", "id": 1, "questions": [q("keep", "red"), q("v075", "blue"), q("t025", "green"),
                                                     q("both", "white")]},
          {"image": "b.png", "id": 2, "questions": [q("t025b", "red")]}]
  truth = {"keep": "red", "v075": "blue", "t025": "green", "both": "white", "t025b": "red"}
  # Correct calls out of 4 rounds: visual accuracy must be > 0.75 and text accuracy < 0.25.
  vision = Scripted({"keep": 4, "v075": 3, "t025": 4, "both": 2, "t025b": 4}, truth)
  text = Scripted({"keep": 0, "v075": 0, "t025": 1, "both": 2, "t025b": 1}, truth)
  out = eval_lib.curate_file(write_jsonl(tmp_path / "qa.jsonl", rows), str(tmp_path / "out.jsonl"), vision=vision,
                             text=text, config=eval_lib.CurateConfig(workers=2))
  assert all(vision.images) and not any(text.images) and len(vision.images) == len(text.images) == 20
  assert {k: out[k] for k in ("images", "questions", "kept", "dropped_visual", "dropped_text", "dropped_both",
                              "images_kept", "images_without_questions")} == \
    {"images": 2, "questions": 5, "kept": 1, "dropped_visual": 1, "dropped_text": 2, "dropped_both": 1,
     "images_kept": 1, "images_without_questions": 1}
  written = [json.loads(line) for line in open(tmp_path / "out.jsonl")]
  assert written == [{"image": "a.png", "id": 1, "questions": [
    {"question": "keep", "options": ["red", "blue", "green", "white"], "answer": "A", "visual_acc": 1.0,
     "text_acc": 0.0}]}]
  assert json.load(open(tmp_path / "out.jsonl.stats.json"))["kept"] == 1
  assert "| keep rate | 0.200 |" in open(tmp_path / "out.jsonl.stats.md").read()
  bad = write_jsonl(tmp_path / "bad.jsonl", [rows[0], {"image": "missing.png", "questions": rows[0]["questions"]}])
  with pytest.raises(data_lib.DataError, match=r"bad.jsonl:2: image not found"):
    eval_lib.curate_file(bad, str(tmp_path / "o2.jsonl"), vision=vision, text=text)


TEACHERS = ["A carrot cake reading 24 CARROT CAKE on a wooden table.",
            "A cake with '24 carrot cake' written on it, on a wooden table, beside a fork.",
            "A cake and a red mug."]


def writer_reply(criteria):
  return "```json\n" + json.dumps({"rubrics": criteria}) + "\n```"


def test_rubric_synthesis_keeps_consensus_failures_only(tmp_path):
  judge_srv = serve.ServerThread(fake_vlm_app(), port=0).start()
  try:
    crit = [{"criterion": "[[ok:Score: 0]] names the text 24 CARROT CAKE", "severity": "Critical",
             "support": [{"teacher": 1, "quote": "24 CARROT CAKE"}, {"teacher": 2, "quote": "24 carrot cake"}]},
            {"criterion": "[[ok:Score: 1]] says the table is wooden", "severity": "minor",     # the student does
             "support": [{"teacher": 1, "quote": "wooden table"}, {"teacher": 2, "quote": "a wooden table"}]},
            {"criterion": "[[ok:Score: 0]] mentions the red mug", "severity": "important",   # one teacher only
             "support": [{"teacher": 3, "quote": "red mug"}, {"teacher": 1, "quote": "red mug"}]},
            {"criterion": "[[ok:Score: 0]] mentions the fork", "severity": "important",
             "support": [{"teacher": 2, "quote": "beside a fork"}, {"teacher": 3, "quote": "and a red"}]}]
    seen = []

    def writer(messages, **_):
      seen.append(messages[-1]["content"])
      return writer_reply(crit)

    rows = [{"image": "a.png", "teacher_captions": TEACHERS, "student_caption": "A cake on a wooden table."}]
    images(tmp_path, "a.png")
    path = write_jsonl(tmp_path / "committee.jsonl", rows)
    out = eval_lib.synthesize_file(path, str(tmp_path / "rubrics.jsonl"), writer=writer,
                                   judge={"base_url": judge_srv.url, "max_retries": 0})
    assert "[1] A carrot cake" in seen[0] and "[3] A cake and a red mug." in seen[0] and "A cake on a wooden" in seen[0]
    assert {k: out[k] for k in ("proposed", "unsupported", "already_met", "kept")} == \
      {"proposed": 4, "unsupported": 1, "already_met": 1, "kept": 2}
    assert out["severity"] == {"critical": 1, "important": 1, "minor": 0}
    got = json.loads(open(tmp_path / "rubrics.jsonl").read())["rubrics"]
    assert [(r["severity"], r["weight"], r["teachers"]) for r in got] == [("critical", 3.0, [1, 2]),
                                                                          ("important", 2.0, [2, 3])]
    # The written file is what the reward reads.
    from jaxrl import rewards
    assert rewards.read_rubric_lines(open(tmp_path / "rubrics.jsonl").read().splitlines(), "r") == \
      [[{"criterion": got[0]["criterion"], "weight": 3.0}, {"criterion": got[1]["criterion"], "weight": 2.0}]]
  finally:
    judge_srv.stop()
  # Without a judge nothing is dropped for being met; a malformed answer names the input line.
  no_judge, _ = eval_lib.synthesize_rubrics(eval_lib.read_image_records(path, ()), writer=lambda m, **_: writer_reply(crit))
  assert len(no_judge[0]["rubrics"]) == 3
  two = write_jsonl(tmp_path / "two.jsonl", [rows[0], rows[0]])
  calls = Counter()

  def flaky(messages, **_):
    calls["n"] += 1
    return writer_reply(crit) if calls["n"] == 1 else '{"rubrics": [{"criterion": "x", "severity": "minor"'

  with pytest.raises(data_lib.DataError, match=r"two.jsonl:2: the rubric writer's answer is not JSON"):
    eval_lib.synthesize_file(two, str(tmp_path / "r2.jsonl"), writer=flaky, config=eval_lib.SynthConfig(workers=1))
  calls.clear()
  out = eval_lib.synthesize_file(two, str(tmp_path / "r3.jsonl"), writer=flaky,
                                 config=eval_lib.SynthConfig(workers=1, on_error="skip"))
  assert out["writer_errors"] == 1 and out["images"] == 2 and len(open(tmp_path / "r3.jsonl").readlines()) == 1
  with pytest.raises(data_lib.DataError, match=r"two1.jsonl:1: 'teacher_captions' must list at least two"):
    eval_lib.synthesize_file(write_jsonl(tmp_path / "two1.jsonl", [{**rows[0], "teacher_captions": ["one"]}]),
                             str(tmp_path / "r4.jsonl"), writer=flaky)


REASONER = {  # question -> the reasoning model's answer
  "What is 2+2?": "<think>The figure shows 2 and 2; 2+2=4.</think> \\boxed{4}",       # kept
  "What is 3+3?": "<think>3+3=7</think> \\boxed{7}",                                    # wrong answer
  "What is 4+4?": "4+4 = 8, so \\boxed{8}",                                             # no think block
  "What is 5+5?": "5 and 5 make 10.\n</think>\n\n\\boxed{10}",                          # R1-distill style: kept
}


def test_cold_start_bridges_filters_and_pairs_with_the_image(tmp_path):
  images(tmp_path, "g.png")
  mllm_calls, reasoner_calls = [], []

  def mllm(messages, **kw):
    mllm_calls.append((messages, kw))
    return "The image shows two numbers.\nDraft: add them."

  def reasoner(messages, **kw):
    reasoner_calls.append(messages)
    text = messages[-1]["content"]
    assert isinstance(text, str) and "The image shows two numbers." in text and "Draft: add them." in text
    return REASONER[re.search(r"Question: (.*)", text).group(1)]

  rows = [{"image": "g.png", "question": k, "answer": str(2 * (i + 2))} for i, k in enumerate(REASONER)]
  out = eval_lib.cold_start_file(write_jsonl(tmp_path / "q.jsonl", rows), str(tmp_path / "cold.jsonl"), mllm=mllm,
                                 reasoner=reasoner)
  # The builder calls the models from a thread pool, so the calls arrive in any order.
  (messages, kw), = [c for c in mllm_calls if "What is 2+2?" in c[0][-1]["content"][1]["text"]]
  assert messages[-1]["content"][0]["type"] == "image_url" and kw["temperature"] == 0.6
  assert len(mllm_calls) == len(REASONER)
  assert {k: out[k] for k in ("examples", "kept", "format_fail", "wrong_answer")} == \
    {"examples": 4, "kept": 2, "format_fail": 1, "wrong_answer": 1}
  got = [json.loads(line) for line in open(tmp_path / "cold.jsonl")]
  assert got[0]["messages"] == [
    {"role": "user", "content": [{"type": "image", "image": "g.png"}, {"type": "text", "text": "What is 2+2?"}]},
    {"role": "assistant", "content": REASONER["What is 2+2?"]}]
  assert got[1]["messages"][1]["content"].startswith("<think>\n5 and 5") and got[1]["answer"] == "10"
  assert got[0]["source"].endswith("q.jsonl:1") and got[1]["source"].endswith("q.jsonl:4")
  assert "| kept (hard reward = 1) | 2 |" in open(tmp_path / "cold.jsonl.stats.md").read()


def fake_vlm_app():
  """An OpenAI-compatible fake: a message tagged ``[[ok:TEXT]]`` gets TEXT; otherwise, with an image part it
  describes, without one it reasons to 4."""
  app = FastAPI()

  @app.post("/v1/chat/completions")
  async def chat(request: Request):
    body = await request.json()
    content = body["messages"][-1]["content"]
    text = "a picture of 2 + 2" if isinstance(content, list) else "<think>2 + 2 = 4</think> \\boxed{4}"
    tag = re.search(r"\[\[ok:([^\]]*)\]\]", content if isinstance(content, str) else "")
    text = tag.group(1) if tag else text
    return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
  return app


def test_cold_start_command_against_a_server_and_its_errors(tmp_path, capsys):
  images(tmp_path, "g.png")
  data = write_jsonl(tmp_path / "q.jsonl", [{"image": "g.png", "question": "2+2?", "answer": "4"},
                                             {"image": "g.png", "question": "2+3?", "answer": "5"}])
  with serve.ServerThread(fake_vlm_app(), port=0) as srv:
    status = cli_main(["vision-r1-coldstart", "--data", data, "--out", str(tmp_path / "o.jsonl"),
                       "--mllm-base-url", srv.url, "--reasoner-base-url", srv.url, "--reasoner-model", "r1"])
  out = capsys.readouterr().out
  assert status == 0 and "| examples | 2 |" in out and "| kept (hard reward = 1) | 1 |" in out
  assert len(open(tmp_path / "o.jsonl").readlines()) == 1
  bad = write_jsonl(tmp_path / "bad.jsonl", [{"image": "nope.png", "questions": []}])
  status = cli_main(["caprl-curate", "--data", bad, "--out", str(tmp_path / "c.jsonl"),
                     "--vision-base-url", "http://127.0.0.1:9/v1", "--text-base-url", "http://127.0.0.1:9/v1"])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and len(err) == 1 and err[0].startswith("jaxrl caprl-curate: error: ") and "bad.jsonl:1" in err[0]
  status = cli_main(["rubicap-rubrics", "--data", bad, "--out", str(tmp_path / "r.jsonl")])
  assert status == 2 and "--writer-base-url or --writer-launch is required" in capsys.readouterr().err


def test_endpoint_options_become_a_judge_config(tmp_path):
  import argparse

  from jaxrl.cli import vlrl
  p = argparse.ArgumentParser()
  vlrl.add_endpoint(p, "writer", "w")
  vlrl.add_endpoint(p, "judge", "j", required=False)
  args = p.parse_args(["--writer-base-url", "http://h:1/v1", "--writer-model", "gem", "--writer-cache",
                       str(tmp_path / "c.db"), "--writer-judge", '{"max_tokens": 3000, "timeout_s": 5}'])
  assert vlrl.endpoint(args, "writer") == {"provider": "jaxrl", "max_concurrency": 8, "base_url": "http://h:1/v1",
                                           "model": "gem", "cache_path": str(tmp_path / "c.db"), "max_tokens": 3000,
                                           "timeout_s": 5}
  assert vlrl.endpoint(args, "judge", required=False) is None
  args = p.parse_args(["--writer-launch", str(tmp_path)])
  assert vlrl.endpoint(args, "writer")["launch"] == {"model": str(tmp_path)}
  with pytest.raises(ValueError, match="--writer-judge: expected a JSON object"):
    vlrl.endpoint(p.parse_args(["--writer-base-url", "u", "--writer-judge", "[1]"]), "writer")
