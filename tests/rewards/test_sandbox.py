"""Sandbox containment: each hostile program ends as reward 0 with a reason, and the host is fine."""

import os
import socket
import threading
import uuid

import pytest

from jaxrl.rewards import SandboxConfig, SandboxError, code_reward, run_program, sandbox_info
from jaxrl.rewards._sandbox import _uid_pids

INFO = sandbox_info()
STRONG = INFO["isolation"] == "strong"
NETNS = INFO["isolation"] in ("strong", "netns")
needs_strong = pytest.mark.skipif(not STRONG, reason=f"needs strong isolation (root); here: {INFO['isolation']}")
needs_netns = pytest.mark.skipif(not NETNS, reason=f"needs a network namespace; here: {INFO['isolation']}")


def _reward(program: str, expected: str = "done", timeout_s: float = 2.0):
  completion = f"```python\n{program}\n```"
  r = code_reward("", completion, tests=[{"input": "", "output": expected}], config={"timeout_s": timeout_s})
  (record,) = r.info["tests"]
  return r, record


def _assert_gone(record):
  with pytest.raises(ProcessLookupError):
    os.killpg(record["pid"], 0)
  if record["uid"] is not None:
    assert _uid_pids(record["uid"]) == []


def test_sandbox_info_reports_the_active_mechanisms():
  levels = INFO["levels"]
  first = next(name for name in ("strong", "netns", "basic") if levels[name]["available"])
  assert INFO["isolation"] == first
  assert {"network", "filesystem", "processes", "rlimits", "env"} <= set(INFO)
  if os.geteuid() == 0:
    assert levels["strong"]["available"], levels["strong"]["why_not"]


def test_infinite_loop_times_out():
  r, rec = _reward("while True:\n  pass", timeout_s=2.0)
  assert (r.value, r.info["reason"]) == (0.0, "timeout")
  assert rec["wall_s"] < 2.0 + 3.0
  _assert_gone(rec)


def test_fork_bomb_is_contained_and_host_keeps_spawning():
  bomb = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass"
  out = {}
  t = threading.Thread(target=lambda: out.update(zip(("r", "rec"), _reward(bomb, timeout_s=2.0))))
  t.start()
  during = run_program("print(6 * 7)", timeout_s=5.0)  # the host and other sandboxes still work
  t.join(30)
  assert during.status == "ok" and during.stdout == "42\n"
  assert (out["r"].value, out["r"].info["reason"]) == (0.0, "timeout")
  _assert_gone(out["rec"])


def test_huge_allocation_is_refused_by_rlimit_as():
  r, rec = _reward("x = bytearray(50 * 2**30)\nprint('done')")
  assert (r.value, r.info["reason"]) == (0.0, "memory")
  _assert_gone(rec)


def test_printing_a_gigabyte_is_cut_by_the_output_cap():
  r, rec = _reward("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n  sys.stdout.write(chunk)")
  assert (r.value, r.info["reason"]) == (0.0, "output_limit")
  _assert_gone(rec)


def test_big_file_is_cut_by_rlimit_fsize():
  cfg = SandboxConfig(max_file_mb=1)
  res = run_program("open('big', 'wb').write(b'x' * (4 << 20))", timeout_s=5.0, config=cfg)
  assert res.status == "file_size_limit"


def test_reading_a_parent_secret_from_env_fails(monkeypatch):
  monkeypatch.setenv("JAXRL_TEST_SECRET", "hunter2-" + uuid.uuid4().hex)
  secret = os.environ["JAXRL_TEST_SECRET"]
  program = (
    "import os\n"
    f"leaks = [k for k, v in os.environ.items() if {secret!r} in v]\n"
    "try:\n"
    f"  leaks += ['proc'] if {secret!r}.encode() in open('/proc/{os.getpid()}/environ', 'rb').read() else []\n"
    "except OSError:\n"
    "  pass\n"
    "print('LEAKED' if leaks else 'clean', sorted(os.environ))"
  )
  r, rec = _reward(program, expected="LEAKED")
  assert (r.value, r.info["reason"]) == (0.0, "wrong_answer")
  assert rec["stdout"].startswith("clean")
  assert "JAXRL_TEST_SECRET" not in rec["stdout"]


def _listener():
  srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  srv.bind(("127.0.0.1", 0))
  srv.listen(1)
  srv.settimeout(0.5)
  return srv


def _assert_no_connection(srv):
  with pytest.raises(socket.timeout):
    srv.accept()
  srv.close()


def test_opening_a_socket_fails():
  srv = _listener()
  port = srv.getsockname()[1]
  r, rec = _reward(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('done')")
  assert (r.value, r.info["reason"]) == (0.0, "runtime_error")
  assert "PermissionError" in rec["stderr"] or "unreachable" in rec["stderr"]
  _assert_no_connection(srv)


@needs_netns
def test_network_namespace_blocks_a_child_without_the_audit_hook():
  srv = _listener()
  port = srv.getsockname()[1]
  child = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('done')"
  program = (
    "import subprocess, sys\n"
    # the base interpreter: a virtualenv under /tmp is not visible inside the sandbox's own /tmp
    f"p = subprocess.run([getattr(sys, '_base_executable', sys.executable), '-I', '-c', {child!r}],"
    " capture_output=True, text=True)\n"
    "print(p.stdout.strip() or p.stderr.strip().splitlines()[-1])"
  )
  r, rec = _reward(program, timeout_s=5.0)
  assert (r.value, r.info["reason"]) == (0.0, "wrong_answer")
  assert "Network is unreachable" in rec["stdout"]
  _assert_no_connection(srv)


@needs_strong
def test_writing_outside_the_temp_dir_fails(tmp_path):
  # a root-owned directory the sandbox can see (read-only for its uid), and the parent's tmp dir;
  # not the checkout, which may itself lie under /tmp (replaced by the run's own dir in the sandbox)
  visible = os.path.join("/usr/local", f"_escape_{uuid.uuid4().hex}.txt")
  hidden = tmp_path / "outside.txt"
  try:
    for target, error in ((visible, "PermissionError"), (str(hidden), "FileNotFoundError")):
      r, rec = _reward(f"open({target!r}, 'w').write('x')\nprint('done')")
      assert (r.value, r.info["reason"]) == (0.0, "runtime_error")
      assert error in rec["stderr"]
      assert not os.path.exists(target)
  finally:
    if os.path.exists(visible):
      os.remove(visible)


@needs_strong
def test_writing_host_tmp_lands_in_the_runs_own_dir():
  name = f"jaxrl-escape-{uuid.uuid4().hex}"
  res = run_program(f"open('/tmp/{name}', 'w').write('x')\nimport os\nprint(sorted(os.listdir('/tmp')))")
  assert res.status == "ok" and name in res.stdout
  assert not os.path.exists(f"/tmp/{name}")


@needs_strong
def test_setsid_escapee_is_killed():
  prog = "import os, time\nif os.fork() == 0:\n  os.setsid()\n  time.sleep(60)\nprint('done')"
  r, rec = _reward(prog)
  assert r.value == 1.0
  _assert_gone(rec)


@needs_strong
def test_program_runs_unprivileged_and_sees_only_its_own_processes():
  res = run_program("import os\nprint(os.getuid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
  uid, pids = res.stdout.split(maxsplit=1)
  assert int(uid) == res.uid != 0
  assert pids.strip() == "[1]"


def test_cwd_is_fresh_and_not_shared_between_runs():
  first = run_program("open('note.txt', 'w').write('x')\nimport os\nprint(sorted(os.listdir('.')))")
  second = run_program("import os\nprint(sorted(os.listdir('.')))")
  assert first.stdout.strip() == "['main.py', 'note.txt']"
  assert second.stdout.strip() == "['main.py']"


def test_environment_is_the_allow_list():
  res = run_program("import os\nprint(sorted(os.environ))", config=SandboxConfig(env={"EXTRA": "1"}))
  assert eval(res.stdout) == sorted(INFO["env"] + ["EXTRA"])  # noqa: S307 (our own printed list)


def test_unusable_interpreter_raises_sandbox_error():
  with pytest.raises(SandboxError):
    run_program("print(1)", config=SandboxConfig(python="/nonexistent/python3"))
