"""Tools, tool-call parsing and the tool environment: exact values, BM25 by hand, every bad-call class."""

import json
import math
import threading

import pytest

from jaxrl import envs


def test_calculator_is_exact_on_big_numbers():
  assert envs.calculate("123456789 * 987654321") == str(123456789 * 987654321)
  assert envs.calculate("(2^100 - 1) / 3") == str((2**100 - 1) // 3)
  assert envs.calculate("-(7 - 10) * 2 ** 3") == "24"
  assert envs.calculate("7/2") == "7/2"
  for bad in ("x + 1", "1/0", "2^(1/2)", "10^100000"):
    with pytest.raises((ValueError, ZeroDivisionError)):
      envs.calculate(bad)


def test_bm25_matches_hand_computed_scores():
  docs = ["the cat sat", "dogs and cats", "the the the dog"]
  bm = envs.BM25(docs, k1=1.5, b=0.75)
  # By hand: N=3, |D| = 3, 3, 4, avgdl = 10/3; "the" in 2 docs, "dog" in 1.
  idf = lambda n: math.log(1 + (3 - n + 0.5) / (n + 0.5))
  term = lambda f, dl: f * 2.5 / (f + 1.5 * (0.25 + 0.75 * dl / (10 / 3)))
  want = [idf(2) * term(1, 3), 0.0, idf(2) * term(3, 4) + idf(1) * term(1, 4)]
  got = bm.scores("the dog")
  assert got.tolist() == pytest.approx(want, rel=1e-12)
  assert [j for j, _ in bm.top("the dog", 5)] == [2, 0]


def test_search_tool_reads_a_jsonl_collection(tmp_path):
  path = tmp_path / "docs.jsonl"
  path.write_text("\n".join(json.dumps(d) for d in [
      {"id": "a", "title": "Paris", "text": "Paris is the capital of France."},
      {"id": "b", "text": "Berlin is the capital of Germany."}]))
  tool = envs.make_tool("search", collection=str(path), top_k=1)
  assert tool(query="capital of Germany") == "[b] Berlin is the capital of Germany."
  assert tool(query="zebra") == "no results"


def test_parse_hermes_and_llama3_calls():
  text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
          '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
  got = envs.parse_tool_calls(text)
  assert got.calls == (envs.ToolCall("calculator", {"expression": "2*3"}),
                       envs.ToolCall("python", {"code": "print(1)"}))
  assert not got.errors
  assert not envs.parse_tool_calls("Answer: 6").has_calls
  bad = envs.parse_tool_calls('<tool_call>{"name": 3}</tool_call><tool_call>{oops</tool_call><tool_call>{"name"')
  assert [e.kind for e in bad.errors] == ["malformed"] * 3 and not bad.calls
  llama = envs.parse_tool_calls('<|python_tag|>{"name": "a", "parameters": {"s": "x;y}"}}; '
                                '{"name": "b", "parameters": {}}',
                                fmt="llama3")
  assert llama.calls == (envs.ToolCall("a", {"s": "x;y}"}), envs.ToolCall("b", {}))
  assert not envs.parse_tool_calls("The answer is 4.", fmt="llama3").has_calls
  roundtrip = envs.parse_tool_calls(envs.format_tool_call("a", {"q": 1}, fmt="llama3"), fmt="llama3")
  assert roundtrip.calls[0].arguments == {"q": 1}


class _Blocking:
  name, description, parameters = "block", "waits for an event", {}

  def __init__(self):
    self.release = threading.Event()

  def __call__(self):
    self.release.wait()
    return "late"


class _Loud:
  name, description, parameters = "loud", "prints a lot", {"n": (int, True)}

  def __call__(self, *, n):
    return "x" * n


class _Broken:
  name, description, parameters = "broken", "raises", {}

  def __call__(self):
    raise KeyError("boom")


def test_every_bad_call_class_is_a_counted_error_observation():
  blocking = _Blocking()
  ex = envs.ToolExecutor([envs.Calculator(), blocking, _Loud(), _Broken()], timeout_s=0.5, max_output_chars=50)
  env = envs.ToolEnv(executor=ex, max_turns=10, max_tool_calls=7, system_prompt="")
  env.reset({"prompt": "q", "answer": "6"})
  call = lambda name, args: envs.format_tool_call(name, args)
  turn = "".join([
      "<tool_call>{not json</tool_call>",  # malformed
      call("nope", {}),  # unknown_tool
      call("calculator", {"expr": "1"}),  # bad_arguments (unexpected / missing)
      call("calculator", {"expression": 5}),  # bad_arguments (wrong type)
      call("block", {}),  # timeout: returns while the tool is still blocked
      call("loud", {"n": 500}),  # output_too_long
  ])
  try:
    obs, reward, done, info = env.step(turn)
    assert not blocking.release.is_set()  # the executor did not wait for the blocked tool
  finally:
    blocking.release.set()
  kinds = [r.error for r in info["tool_results"]]
  assert kinds == ["malformed", "unknown_tool", "bad_arguments", "bad_arguments", "timeout", "output_too_long"]
  assert not done and reward == 0.0 and len(obs) == 6
  assert all(m["role"] == "tool" and m["content"] for m in obs)
  assert len(obs[5]["content"]) < 120
  obs, _, _, info = env.step(call("broken", {}) + call("calculator", {"expression": "2*3"}))
  assert [r.error for r in info["tool_results"]] == ["tool_error", "limit"]  # 6 + 2 > max_tool_calls=7
  m = env.metrics()
  assert m["tool_calls"] == 8 and m["tool_errors"] == 8
  assert {k: m[f"tool_errors/{k}"] for k in envs.ERROR_KINDS} == {
      "malformed": 1, "unknown_tool": 1, "bad_arguments": 2, "timeout": 1, "output_too_long": 1, "tool_error": 1,
      "limit": 1}
  # A malformed call spoils the format: the final answer earns the format penalty.
  assert env.step("Answer: 6").reward == -1.0
  ex.close()


def test_python_tool_runs_in_the_sandbox_and_times_out():
  ok = envs.ToolExecutor([envs.PythonTool(timeout_s=30.0)], timeout_s=60.0).run(
      [envs.ToolCall("python", {"code": "print(2**70)"})])[0]
  assert (ok.error, ok.content.strip()) == (None, str(2**70))
  slow = envs.ToolExecutor([envs.PythonTool(timeout_s=1.0)], timeout_s=60.0).run(
      [envs.ToolCall("python", {"code": "while True: pass"})])[0]
  assert slow.error == "timeout"  # killed by the sandbox's own limit, reported as a timeout


def test_hierarchical_reward_and_multi_tool_bonus():
  make = envs.env_factory("tools", tools={"calculator": {}, "python": {}}, system_prompt="", multi_tool_bonus=0.1)
  env = make()
  env.reset({"prompt": "2*3?", "answer": "6"})
  obs, r, done, _ = env.step(envs.format_tool_call("calculator", {"expression": "2*3"}))
  assert obs == [{"role": "tool", "content": "6"}] and not done
  assert env.step("Answer: 6").reward == 1.0  # one tool: no bonus
  env = make()
  env.reset({"prompt": "2*3?", "answer": "6"})
  env.step(envs.format_tool_call("calculator", {"expression": "2*3"})
           + envs.format_tool_call("python", {"code": "print(6)"}))
  assert env.step("Answer: 6").reward == pytest.approx(1.1)  # two different tools: + r_M
  env = make()
  env.reset({"prompt": "2*3?", "answer": "6"})
  assert env.step("Answer: 7").reward == 0.0  # good format, wrong
  env = make()
  env.reset({"prompt": "2*3?", "answer": "6"})
  assert env.step("no idea").reward == -1.0  # no answer: bad format
  with pytest.raises(ValueError, match="unknown environment"):
    envs.env_factory("nope")
  with pytest.raises(ValueError, match="unknown tool"):
    envs.env_factory("tools", tools={"abacus": {}})


def test_hanging_and_crashing_tools_in_the_reward_process_pool(tmp_path):
  """Tool calls in the reward runner's process pool: a hung call is a timeout observation and its
  worker is killed (the pool replaced); a call that kills its worker is a tool_error observation;
  neither uses up the reward runner's restart budget, and the pool serves the next calls."""
  import envs_testlib
  from jaxrl.rewards import RewardRunner, RewardRunnerConfig
  runner = RewardRunner("jaxrl.rl:arithmetic_reward",
                        config=RewardRunnerConfig(executor="process", workers=1, max_worker_restarts=0))
  tools = [envs.Calculator(), envs_testlib.Hang(), envs_testlib.Crash()]
  patient = envs.ToolExecutor(tools, timeout_s=300.0, runner=runner)  # worker start-up under load
  quick = envs.ToolExecutor(tools, timeout_s=2.0, runner=runner)
  call = lambda name, args: envs.parse_tool_calls(envs.format_tool_call(name, args)).calls[0]
  try:
    assert [r.content for r in patient.run([call("calculator", {"expression": "2*3"})])] == ["6"]
    first = runner._pool
    workers = list(first._processes.values())
    env = envs.ToolEnv(executor=quick, max_turns=10, max_tool_calls=10, system_prompt="")
    env.reset({"prompt": "q", "answer": "6"})
    pid_file = tmp_path / "pid"
    _, _, done, info = env.step(envs.format_tool_call("hang", {"pid_file": str(pid_file)}))
    assert [r.error for r in info["tool_results"]] == ["timeout"] and not done
    assert runner._pool is not first  # the hung worker's pool was replaced ...
    for proc in workers:
      proc.join(60)
    assert [p.pid for p in workers] == [int(pid_file.read_text())]
    assert workers[0].exitcode == -9  # ... and the hung worker killed
    env.executor = patient
    _, _, _, info = env.step(envs.format_tool_call("crash", {}))
    assert [(r.error, "crashed" in r.content) for r in info["tool_results"]] == [("tool_error", True)]
    assert [r.content for r in patient.run([call("calculator", {"expression": "7*6"})])] == ["42"]
    m = env.metrics()
    assert (m["tool_errors/timeout"], m["tool_errors/tool_error"], m["tool_errors"]) == (1.0, 1.0, 2.0)
    assert runner.restarts == 0
  finally:
    for proc in workers if "workers" in locals() else []:  # never leave a hung worker behind a failure
      proc.kill()
    runner.close(wait=False)
    patient.close()
    quick.close()
