"""On-policy distillation from a teacher behind ``jaxrl serve`` (``distill.server``): the server's log-probs of a
rollout against a float32 padded forward of the in-process teacher's own log-prob program, one RL step with the
server teacher against one with the in-process teacher (same seed), and the refusals: another tokenizer, gkd, a
server that fails (HTTP status and request named)."""

from __future__ import annotations

import pathlib
import shutil
import types

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from jaxrl import config as config_lib
from jaxrl import data, models, sampling, serve
from jaxrl.rl import RLConfig, RLTrainer, ServerTeacher, TeacherServerConfig

from rl_testlib import make_config

TEACHER = {"preset": "tiny", "seed": 7, "overrides": {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 192,
                                                       "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                                                       "dtype": "float32", "param_dtype": "float32"}}
CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
TEMPERATURE = 0.8  # the rollout's: both teachers score log_softmax(logits / 0.8)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
  out = tmp_path_factory.mktemp("teacher")
  model = models.ModelSource(**TEACHER).build()
  models.save_pretrained(model, out, tokenizer=models.load_tokenizer(data.tiny_tokenizer_dir()))
  return str(out)


def _serve(app):
  return serve.ServerThread(app, port=0).start()


@pytest.fixture(scope="module")
def teacher_sampler(teacher_dir):
  return sampling.Sampler(models.load_pretrained(teacher_dir, dtype="float32"), models.load_tokenizer(teacher_dir),
                          max_len=128)


@pytest.fixture(scope="module")
def server(teacher_sampler):
  srv = _serve(serve.create_app(teacher_sampler, model_name="teacher", batch_wait_s=0.01))
  yield srv
  srv.stop()


def _cfg(tmp_path, distill, **over):
  over = {"distill": distill, "reward.fn": "rl_testlib:digit_fraction", "rollout.temperature": TEMPERATURE,
          "steps": 1, **over}
  return make_config(tmp_path, **over)


def _server_section(srv, **kw):
  return {"server": {"base_url": srv.url, "model": "teacher", "max_concurrency": 2, "prompts_per_request": 5, **kw}}


@pytest.fixture(scope="module")
def both_runs(tmp_path_factory, teacher_dir, server):
  """One RL step with the in-process teacher and one with the server teacher, same seed and student."""
  out = {}
  for name, distill in (("local", {"teacher": {"hf_dir": teacher_dir}}), ("server", _server_section(server))):
    trainer = RLTrainer(_cfg(tmp_path_factory.mktemp(name), distill))
    try:
      trainer.run()
    finally:
      trainer.close()
    out[name] = trainer
  return out


def test_server_logprobs_equal_in_process_teacher_program(both_runs, server):
  local = both_runs["local"]
  ro = local.last_rollout
  client = ServerTeacher(TeacherServerConfig(base_url=server.url, model="teacher", prompts_per_request=3),
                         student_tokenizer=local.tokenizer, student="s", temperature=TEMPERATURE)
  try:
    got = client.logprobs(ro)  # [N, L]
  finally:
    client.close()
  # The in-process teacher's log-prob program over one padded row per sequence (prompt + response[:-1]).
  seqs = [np.concatenate([ro.prompt_ids[i], ro.tokens[i, :int(ro.lengths[i])]]) for i in range(ro.num_samples)]
  width = max(len(s) for s in seqs) - 1
  pad = lambda x: np.pad(x, (0, width - len(x)))  # noqa: E731
  mb = {"tokens": np.stack([pad(s[:-1]) for s in seqs]).astype(np.int32),
        "targets": np.stack([pad(s[1:]) for s in seqs]).astype(np.int32),
        "positions": np.broadcast_to(np.arange(width, dtype=np.int32), (len(seqs), width)),
        "segment_ids": (np.arange(width)[None] < np.asarray([len(s) - 1 for s in seqs])[:, None]).astype(np.int32)}
  full = np.asarray(local.teacher.logprob_fn(local.teacher.params, mb))  # [N, W]: target t = seq[t + 1]
  want = np.zeros_like(got)
  for i in range(len(seqs)):  # response token k is target P - 1 + k
    p, n = len(ro.prompt_ids[i]), int(ro.lengths[i])
    want[i, :n] = full[i, p - 1:p - 1 + n]
  assert ro.response_mask().sum() > 40
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
  assert np.all(got[ro.response_mask() == 0] == 0.0)
  assert np.abs(got - ro.logprobs)[ro.response_mask() > 0].mean() > 1e-2  # the teacher, not the student's


def test_one_step_with_server_teacher_equals_in_process_teacher(both_runs):
  local, remote = both_runs["local"], both_runs["server"]
  assert np.array_equal(local.last_rollout.tokens, remote.last_rollout.tokens)  # same seed: the same rollout
  a, b = local.history[-1], remote.history[-1]
  assert abs(a["distill/reverse_kl"]) > 1e-2
  for key in ("loss", "distill/reverse_kl", "advantage/abs_mean", "grad_norm"):
    np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-6, err_msg=key)
  for ua, ub in zip(local.update_history, remote.update_history, strict=True):
    assert ua.keys() == ub.keys() and "ratio_max" in ua
    for key in ua:
      np.testing.assert_allclose(ub[key], ua[key], rtol=1e-4, atol=1e-6, err_msg=key)


def _student_tokenizer():
  return models.load_tokenizer(data.tiny_tokenizer_dir())


def test_server_with_another_tokenizer_is_refused(tmp_path, teacher_sampler, server):
  tok = _student_tokenizer()
  assert models.tokenizer_fingerprint(tok) == models.tokenizer_fingerprint(teacher_sampler.tokenizer)
  other = tmp_path / "other_tok"
  shutil.copytree(data.tiny_tokenizer_dir(), other)
  changed = models.load_tokenizer(str(other))
  changed.add_tokens(["<extra_teacher_token>"])
  assert models.tokenizer_fingerprint(changed) != models.tokenizer_fingerprint(tok)
  srv = _serve(serve.create_app(teacher_sampler, changed, model_name="teacher"))
  try:
    with pytest.raises(ValueError, match=r"tokenizer differs .*fingerprints sha256:\w+ vs sha256:\w+.*student s1"):
      ServerTeacher(TeacherServerConfig(base_url=srv.url, model="teacher"), student_tokenizer=tok, student="s1",
                    temperature=1.0)
  finally:
    srv.stop()
  with pytest.raises(ValueError, match=r"'other' is not served at .*/v1/models .*\['teacher'\]"):
    ServerTeacher(TeacherServerConfig(base_url=server.url, model="other"), student_tokenizer=tok, student="s",
                  temperature=1.0)


def test_gkd_and_bad_sections_with_a_server_are_refused():
  load = lambda *o: config_lib.load(RLConfig, CONFIGS / "distill_tiny.yaml", list(o))  # noqa: E731
  srv = 'distill.server={"base_url": "http://127.0.0.1:1/v1", "model": "t"}'
  with pytest.raises(ValueError, match=r"distill.server: mode 'gkd' needs the teacher's full next-token"):
    load("distill.teacher=null", srv, "distill.mode=gkd")
  with pytest.raises(ValueError, match=r"exactly one of distill.teacher .* and distill.server .*got both"):
    load(srv)
  with pytest.raises(ValueError, match="got neither"):
    load("distill.teacher=null")
  with pytest.raises(ValueError, match="distill.server.max_concurrency must be >= 1"):
    load("distill.teacher=null", srv, "distill.server.max_concurrency=0")
  assert load("distill.teacher=null", srv).distill.server.model == "t"


def _rollout(prompt_len, n):
  """The fields :meth:`ServerTeacher.logprobs` reads, for two samples."""
  return types.SimpleNamespace(prompt_ids=(np.full(prompt_len, 7, np.int32),) * 2,
                               tokens=np.full((2, n), 9, np.int32), lengths=np.asarray([n, n - 1]), num_samples=2)


def test_server_errors_name_the_request_and_status(server):
  tok = _student_tokenizer()
  client = ServerTeacher(TeacherServerConfig(base_url=server.url, model="teacher"), student_tokenizer=tok,
                         student="s", temperature=1.0)
  try:
    assert client.logprobs(_rollout(10, 4)).shape == (2, 4)
    with pytest.raises(RuntimeError, match=r"POST http://.*/v1/completions \(rollout samples 0..1\) answered "
                                           r"HTTP 400: prompt: This model's maximum context length is 128"):
      client.logprobs(_rollout(125, 4))  # 129 tokens > the server's max_len
  finally:
    client.close()
  app = FastAPI()  # a server that lists the right tokenizer, then fails every scoring request
  listed = {"data": [{"id": "teacher", "tokenizer_fingerprint": models.tokenizer_fingerprint(tok)}]}
  app.get("/v1/models")(lambda: listed)
  calls = []

  def overloaded():
    calls.append(1)
    return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)

  app.post("/v1/completions")(overloaded)
  srv = _serve(app)
  try:
    client = ServerTeacher(TeacherServerConfig(base_url=srv.url, model="teacher", max_retries=2, backoff_s=0.01),
                           student_tokenizer=tok, student="s", temperature=1.0)
    with pytest.raises(RuntimeError, match=r"completions \(rollout samples 0..1\) answered HTTP 503: overloaded "
                                           r"\(gave up after 3 tries\)"):
      client.logprobs(_rollout(4, 3))
    assert len(calls) == 3 and client.retries == 2  # a 503 is retried max_retries times, then raised
    client.close()
    bare = FastAPI()
    bare.get("/v1/models")(lambda: {"data": [{"id": "teacher"}]})  # e.g. another server: no fingerprint
    srv2 = _serve(bare)
    try:
      with pytest.raises(ValueError, match="reports no tokenizer_fingerprint for 'teacher'"):
        ServerTeacher(TeacherServerConfig(base_url=srv2.url, model="teacher"), student_tokenizer=tok, student="s",
                      temperature=1.0)
    finally:
      srv2.stop()
  finally:
    srv.stop()
  with pytest.raises(RuntimeError, match=r"GET http://127.0.0.1:1/v1/models .* failed: ConnectError.*"
                                         r"\(gave up after 2 tries\)"):
    ServerTeacher(TeacherServerConfig(base_url="http://127.0.0.1:1/v1", model="teacher", max_retries=1,
                                      backoff_s=0.01), student_tokenizer=tok, student="s", temperature=1.0)


def test_transient_failures_are_retried_and_the_answer_is_the_servers(server):
  """A teacher server that answers 503, then 429, then passes requests on to the real server: the log-probs equal
  the real server's, two retries are counted; a 400 is not retried; bad retry keys are refused."""
  import httpx

  tok = _student_tokenizer()
  direct = ServerTeacher(TeacherServerConfig(base_url=server.url, model="teacher"), student_tokenizer=tok,
                         student="s", temperature=1.0)
  want = direct.logprobs(_rollout(10, 4))
  direct.close()
  failures = [503, 429]
  seen = []
  app = FastAPI()
  app.get("/v1/models")(lambda: httpx.get(server.url + "/models").json())

  @app.post("/v1/completions")
  async def flaky(body: dict):
    seen.append(body.get("max_tokens"))
    if failures:
      return JSONResponse({"error": {"message": "busy"}}, status_code=failures.pop(0))
    if body.get("max_tokens") == -1:
      return JSONResponse({"error": {"message": "bad max_tokens"}}, status_code=400)
    return httpx.post(server.url + "/completions", json=body, timeout=60).json()

  srv = _serve(app)
  try:
    client = ServerTeacher(TeacherServerConfig(base_url=srv.url, model="teacher", backoff_s=0.01,
                                               max_concurrency=1), student_tokenizer=tok, student="s",
                           temperature=1.0)
    np.testing.assert_array_equal(client.logprobs(_rollout(10, 4)), want)
    assert client.retries == 2 and len(seen) == 3
    with pytest.raises(RuntimeError, match=r"answered HTTP 400: bad max_tokens$"):
      client._call("POST", "/completions", "a bad request", {"model": "teacher", "prompt": [1], "max_tokens": -1})
    assert client.retries == 2 and len(seen) == 4  # not retried
    client.close()
  finally:
    srv.stop()
  for bad, match in (({"max_retries": -1}, "max_retries must be an int >= 0"),
                     ({"backoff_s": 9.0}, "need 0 <= backoff_s <= backoff_max_s")):
    with pytest.raises(ValueError, match=match):
      TeacherServerConfig(base_url="http://x/v1", model="teacher", **bad)
