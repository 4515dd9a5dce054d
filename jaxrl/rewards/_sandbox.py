"""Running untrusted Python in a sandboxed subprocess.

Every run gets: a fresh temp directory as cwd, ``HOME`` and ``TMPDIR``; an environment built
from a short allow-list (no secrets of the parent); ``RLIMIT_CPU``, ``RLIMIT_AS``,
``RLIMIT_NPROC``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE`` and ``RLIMIT_CORE`` set in ``preexec_fn``;
its own session (``start_new_session=True``) whose process group is SIGKILLed when the run ends
or overruns its wall timeout; stdout read with a byte cap (the run is killed past it); and an
audit hook inside the interpreter that refuses IP sockets and DNS. On top of that, the strongest
available isolation level (probed at run time, see `sandbox_info`):

``strong`` (root): new network namespace (no usable interface, not even loopback), new mount
  namespace (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock`` are the run's own directory;
  directories closed to other users are hidden), new PID namespace with its own ``/proc``, a
  unique unprivileged uid per concurrent run (so ``RLIMIT_NPROC`` counts only that run, other
  users' files are read-only and other processes cannot be signalled or inspected) and
  ``no_new_privs``. At the end every process of that uid is killed.
``netns`` (non-root with unprivileged user namespaces): a new user + network namespace.
``basic``: rlimits, session kill, env scrub, temp cwd and the audit hook only.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import math
import os
import random
import resource
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

from jaxrl.rewards import _sandbox_boot as boot

__all__ = ["ExecResult", "SandboxConfig", "SandboxError", "run_function_tests", "run_program", "sandbox_info"]

Isolation = Literal["auto", "strong", "netns", "basic"]
_LEVELS = ("strong", "netns", "basic")
_BOOT = os.path.abspath(boot.__file__)
_SHADOW_CANDIDATES = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue")


class SandboxError(RuntimeError):
  """The sandbox itself failed (not the program): setup error, unavailable isolation level."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxConfig:
  """Resource limits and isolation of sandboxed runs."""

  memory_mb: int = 2048
  """Address-space limit (RLIMIT_AS) per process, MiB."""
  max_processes: int = 32
  """RLIMIT_NPROC: processes *and threads* of the run's uid (strong mode: of the run alone)."""
  max_file_mb: int = 16
  """Largest file the program may write (RLIMIT_FSIZE), MiB."""
  max_open_files: int = 256
  """RLIMIT_NOFILE."""
  max_output_bytes: int = 4 << 20
  """stdout beyond this many bytes kills the run (reason ``output_limit``)."""
  max_stderr_bytes: int = 64 << 10
  """stderr kept for diagnostics (the rest is read and dropped)."""
  isolation: Isolation = "auto"
  """``auto`` takes the strongest level that works here; naming one that does not is an error."""
  python: str | None = None
  """Interpreter for the program; None is this process's ``sys.executable``."""
  env: Mapping[str, str] = dataclasses.field(default_factory=dict)
  """Extra environment variables for the program (added to the allow-list)."""
  uid_base: int = 2_000_000
  """Strong mode: the first uid of the pool of per-run uids."""
  uid_slots: int = 4096
  """Strong mode: size of that pool (an upper bound on concurrent runs on this machine)."""

  def __post_init__(self):
    for name in ("memory_mb", "max_processes", "max_file_mb", "max_open_files", "max_output_bytes",
                 "max_stderr_bytes", "uid_slots"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.isolation not in ("auto", *_LEVELS):
      raise ValueError(f"isolation must be auto/strong/netns/basic, got {self.isolation!r}")
    if not 1000 <= self.uid_base < 2**31 - self.uid_slots:
      raise ValueError(f"uid_base must leave room for uid_slots below 2**31, got {self.uid_base!r}")


@dataclasses.dataclass(frozen=True)
class ExecResult:
  """One sandboxed run."""

  status: str
  """``ok``, ``runtime_error``, ``timeout``, ``memory``, ``output_limit``, ``file_size_limit``,
  ``syntax_error``, ``wrong_answer`` (function tests only) or ``killed`` (another signal)."""
  returncode: int
  stdout: str
  stderr: str
  wall_s: float
  pid: int
  """The sandbox process (also its process-group id); it is gone when the result is returned."""
  uid: int | None
  """The per-run uid in strong mode (all its processes are killed before returning)."""

  @property
  def ok(self) -> bool:
    return self.status == "ok"


# ---------------------------------------------------------------------------------------------
# Isolation detection
# ---------------------------------------------------------------------------------------------


def _python(config: SandboxConfig) -> str:
  return config.python or sys.executable


def _world_traversable(path: str) -> bool:
  try:
    return bool(os.stat(path).st_mode & stat.S_IXOTH)
  except OSError:
    return False


@functools.lru_cache(maxsize=8)
def _mount_plan(python: str, workbase: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
  """``(hide, reveal, shadow)`` for strong mode.

  hide: the topmost directories on the interpreter's paths that other users cannot traverse
  (covered by an empty tmpfs); reveal: the interpreter's directories under them (bound back);
  shadow: world-writable directories replaced by the run's own directory.
  """
  real = os.path.realpath(python)
  needed = {os.path.dirname(real), sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix, workbase}
  needed |= {p for p in sys.path if p and os.path.isdir(p)}
  needed = {os.path.realpath(p) for p in needed}
  hide: set[str] = set()
  reveal: set[str] = set()
  for p in needed:
    parts = p.strip("/").split("/")
    for k in range(1, len(parts)):
      anc = "/" + "/".join(parts[:k])
      if not _world_traversable(anc):
        hide.add(anc)
        reveal.add(p)
        break
  hide = {h for h in hide if not any(h != o and h.startswith(o + "/") for o in hide)}
  reveal = {r for r in reveal if not any(r != o and r.startswith(o + "/") for o in reveal)}
  shadow = []
  for d in _SHADOW_CANDIDATES:
    if os.path.isdir(d) and not os.path.islink(d) and os.stat(d).st_mode & stat.S_IWOTH:
      shadow.append(d)
  return tuple(sorted(hide)), tuple(sorted(reveal)), tuple(shadow)


_PROBE = r"""
import os, socket, sys
try:
  socket.create_connection(("127.0.0.1", 9), timeout=1).close()
  print("net-open")
except OSError:
  print("net-closed")
print("uid", os.getuid())
"""


@functools.lru_cache(maxsize=8)
def _probe(level: str, python: str) -> tuple[bool, str]:
  """Runs a tiny program at `level`; returns whether it worked and why not."""
  if level == "strong" and os.geteuid() != 0:
    return False, "needs root"
  cfg = SandboxConfig(isolation=level, python=python)
  try:
    res = _run(cfg, "script", _PROBE, b"", [], 10.0, 10.0, level=level)
  except (OSError, SandboxError) as e:
    return False, str(e)
  if res.status != "ok":
    return False, f"probe {res.status}: {res.stderr.strip()[-300:]}"
  lines = res.stdout.split()
  if level == "strong" and ("net-closed" not in lines or "0" == lines[-1]):
    return False, f"probe output {res.stdout!r}"
  if level == "netns" and "net-closed" not in lines:
    return False, f"probe output {res.stdout!r}"
  return True, ""


def _resolve_level(config: SandboxConfig) -> str:
  python = _python(config)
  if config.isolation != "auto":
    ok, why = _probe(config.isolation, python)
    if not ok:
      raise SandboxError(f"isolation={config.isolation!r} is unavailable here: {why}")
    return config.isolation
  for level in _LEVELS:
    if _probe(level, python)[0]:
      return level
  raise SandboxError(f"no sandbox level works here: basic: {_probe('basic', python)[1]}")


def sandbox_info(config: SandboxConfig | None = None) -> dict[str, Any]:
  """What the sandbox does on this machine (levels probed by running a tiny program).

  Returns a dict with the chosen ``isolation`` level, whether each level works (and why not),
  and a plain-words description of the network, filesystem, process and resource controls.
  """
  cfg = config or SandboxConfig()
  python = _python(cfg)
  levels = {level: dict(zip(("available", "why_not"), _probe(level, python))) for level in _LEVELS}
  chosen = _resolve_level(cfg)
  hide, reveal, shadow = _mount_plan(python, tempfile.gettempdir())
  network = {
    "strong": "network namespace without interfaces (loopback down) + audit hook",
    "netns": "user+network namespace (loopback down) + audit hook",
    "basic": "Python audit hook only: blocks AF_INET/AF_INET6 connect/bind/sendto and DNS in the "
             "sandboxed interpreter; a child process started without the hook or ctypes can still connect",
  }[chosen]
  filesystem = {
    "strong": f"unprivileged per-run uid: files of other users are read-only; {list(shadow)} are the "
              f"run's own directory; {list(hide)} hidden except {list(reveal)}; RLIMIT_FSIZE caps file size",
    "netns": "same uid as the parent (its files stay writable); cwd/HOME/TMPDIR are a fresh temp dir; RLIMIT_FSIZE",
    "basic": "same uid as the parent (its files stay writable); cwd/HOME/TMPDIR are a fresh temp dir; RLIMIT_FSIZE",
  }[chosen]
  processes = {
    "strong": "PID namespace with its own /proc; RLIMIT_NPROC per unique uid; "
              "every process of the uid killed at the end",
    "netns": "RLIMIT_NPROC counted over the parent's uid (set to its current task count + max_processes); "
             "process group killed at the end (a child that calls setsid escapes)",
    "basic": "as netns",
  }[chosen]
  return {
    "isolation": chosen,
    "levels": levels,
    "euid": os.geteuid(),
    "python": python,
    "network": network,
    "filesystem": filesystem,
    "processes": processes,
    "rlimits": {"RLIMIT_AS_mb": cfg.memory_mb, "RLIMIT_NPROC": cfg.max_processes,
                "RLIMIT_FSIZE_mb": cfg.max_file_mb, "RLIMIT_NOFILE": cfg.max_open_files,
                "RLIMIT_CPU_s": "ceil(wall timeout) + 1", "RLIMIT_CORE": 0},
    "output_cap_bytes": cfg.max_output_bytes,
    "env": sorted(_base_env("/tmp")),
  }


# ---------------------------------------------------------------------------------------------
# Per-run uids (strong mode)
# ---------------------------------------------------------------------------------------------


def _uid_pids(uid: int) -> list[int]:
  """Live (non-zombie) processes whose real uid is `uid`."""
  out = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/status", "rb") as f:
        text = f.read(2048)
    except OSError:
      continue
    uid_line = text.split(b"\nUid:", 1)
    state = text.split(b"\nState:", 1)
    if len(uid_line) == 2 and int(uid_line[1].split()[0]) == uid:
      if len(state) == 2 and state[1].split()[0] == b"Z":
        continue
      out.append(int(name))
  return out


def _kill_uid(uid: int, *, rounds: int = 200) -> None:
  for _ in range(rounds):
    pids = _uid_pids(uid)
    if not pids:
      return
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    time.sleep(0.002)
  raise SandboxError(f"could not kill the processes of sandbox uid {uid}")


@contextmanager
def _claim_uid(config: SandboxConfig) -> Iterator[int]:
  """Holds an exclusive lock on one uid of the pool for the duration of a run."""
  lock_dir = os.path.join(tempfile.gettempdir(), "jaxrl-sandbox-uids")
  os.makedirs(lock_dir, mode=0o700, exist_ok=True)
  start = random.randrange(config.uid_slots)
  for k in range(config.uid_slots):
    slot = (start + k) % config.uid_slots
    fd = os.open(os.path.join(lock_dir, f"{slot}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      continue
    uid = config.uid_base + slot
    try:
      _kill_uid(uid)  # leftovers of a crashed holder
      yield uid
    finally:
      try:
        _kill_uid(uid)
      finally:
        os.close(fd)  # releases the lock
    return
  raise SandboxError(f"all {config.uid_slots} sandbox uids are in use")


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


def _base_env(home: str) -> dict[str, str]:
  return {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": home,
    "TMPDIR": home,
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONHASHSEED": "0",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
  }


def _own_task_count() -> int:
  uid, n = os.getuid(), 0
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        st = os.stat(f"/proc/{name}")
        if st.st_uid == uid:
          n += len(os.listdir(f"/proc/{name}/task"))
      except OSError:
        pass
  return n


def _rlimits(config: SandboxConfig, cpu_s: float, level: str) -> list[tuple[int, int]]:
  cpu = int(math.ceil(cpu_s)) + 1
  nproc = config.max_processes
  if level != "strong" and os.geteuid() != 0:
    nproc += _own_task_count()  # NPROC counts every task of the (shared) uid
  mem = config.memory_mb << 20
  return [
    (resource.RLIMIT_CPU, (cpu, cpu + 1)),
    (resource.RLIMIT_AS, (mem, mem)),
    (resource.RLIMIT_NPROC, (nproc, nproc)),
    (resource.RLIMIT_FSIZE, (config.max_file_mb << 20, config.max_file_mb << 20)),
    (resource.RLIMIT_NOFILE, (config.max_open_files, config.max_open_files)),
    (resource.RLIMIT_CORE, (0, 0)),
  ]


def _preexec(limits: list[tuple[int, tuple[int, int]]]) -> None:
  # Runs in the forked child before exec: only setrlimit calls (no imports, no locks).
  for which, value in limits:
    resource.setrlimit(which, value)


def _communicate(proc: subprocess.Popen, stdin: bytes, deadline: float, config: SandboxConfig):
  """Feeds stdin, reads capped stdout/stderr until EOF, exit or deadline."""
  sel = selectors.DefaultSelector()
  out, err = bytearray(), bytearray()
  pending = memoryview(stdin)
  if pending:
    os.set_blocking(proc.stdin.fileno(), False)
    sel.register(proc.stdin, selectors.EVENT_WRITE)
  else:
    proc.stdin.close()
  sel.register(proc.stdout, selectors.EVENT_READ, out)
  sel.register(proc.stderr, selectors.EVENT_READ, err)
  why = None
  exited_at = None
  try:
    while sel.get_map():
      now = time.monotonic()
      if now >= deadline:
        why = "timeout"
        break
      if exited_at is None and proc.poll() is not None:
        exited_at = now
      if exited_at is not None and now - exited_at > 0.5:
        break  # a leftover child holds the pipes open; it is killed by the caller
      for key, _ in sel.select(timeout=min(0.05, deadline - now)):
        if key.fileobj is proc.stdin:
          try:
            n = os.write(proc.stdin.fileno(), pending[:65536])
            pending = pending[n:]
          except (BrokenPipeError, BlockingIOError) as e:
            if isinstance(e, BrokenPipeError):
              pending = pending[:0]
          if not pending:
            sel.unregister(proc.stdin)
            proc.stdin.close()
          continue
        chunk = os.read(key.fileobj.fileno(), 65536)
        if not chunk:
          sel.unregister(key.fileobj)
          continue
        buf = key.data
        if buf is out:
          buf += chunk
          if len(buf) > config.max_output_bytes:
            why = "output_limit"
            del buf[config.max_output_bytes:]
            return out, err, why
        elif len(buf) < config.max_stderr_bytes:
          buf += chunk[: config.max_stderr_bytes - len(buf)]
  finally:
    sel.close()
  return out, err, why


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _status(rc: int, why: str | None, err: str, mode: str, stdout: str, nonce: str) -> str:
  if why is not None:
    return why
  if rc == boot.EXIT_SETUP and boot.SETUP_MARK in err:
    raise SandboxError(f"sandbox setup failed: {err.strip()[-500:]}")
  sig = -rc if rc < 0 else (rc - boot.EXIT_SIGNAL_BASE if rc > boot.EXIT_SIGNAL_BASE else 0)
  if sig:
    if sig == signal.SIGXCPU:
      return "timeout"
    if sig == signal.SIGXFSZ:
      return "file_size_limit"
    return "killed"
  table = {boot.EXIT_WRONG: "wrong_answer", boot.EXIT_TIMEOUT: "timeout", boot.EXIT_MEMORY: "memory",
           boot.EXIT_SYNTAX: "syntax_error"}
  if rc in table:
    return table[rc]
  if rc != 0:
    return "file_size_limit" if "[Errno 27] File too large" in err else "runtime_error"
  if mode == "function" and not stdout.rstrip("\n").endswith(nonce):
    return "runtime_error"  # exited 0 without finishing the tests (e.g. os._exit(0))
  return "ok"


def _run(
  config: SandboxConfig,
  mode: str,
  program: str,
  stdin: bytes,
  tests: Sequence[str],
  per_test_s: float,
  wall_s: float,
  *,
  level: str | None = None,
) -> ExecResult:
  level = level or _resolve_level(config)
  python = _python(config)
  workdir = tempfile.mkdtemp(prefix="jaxrl-sbx-")
  nonce = secrets.token_hex(16)
  try:
    if level == "strong":
      with _claim_uid(config) as uid:
        return _launch(config, level, mode, program, stdin, tests, per_test_s, wall_s, workdir, nonce, python, uid)
    return _launch(config, level, mode, program, stdin, tests, per_test_s, wall_s, workdir, nonce, python, None)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def _launch(config, level, mode, program, stdin, tests, per_test_s, wall_s, workdir, nonce, python, uid):
  prog = os.path.join(workdir, "main.py")
  with open(prog, "w", encoding="utf-8") as f:
    f.write(program)
  home = workdir
  job: dict[str, Any] = {"isolation": level, "mode": mode, "program": "main.py", "workdir": workdir,
                         "tests": list(tests), "per_test_s": per_test_s, "nonce": nonce}
  if level == "strong":
    hide, reveal, shadow = _mount_plan(python, os.path.dirname(workdir))
    home = "/tmp" if "/tmp" in shadow else workdir
    job |= {"uid": uid, "hide": list(hide), "reveal": list(reveal), "shadow": list(shadow), "home": home}
    os.chown(workdir, uid, uid)
    os.chmod(workdir, 0o700)
  job_path = os.path.join(workdir, "job.json")
  fd = os.open(job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, "w") as f:
    json.dump(job, f)
  env = _base_env(home) | dict(config.env)
  limits = _rlimits(config, wall_s, level)
  t0 = time.monotonic()
  proc = subprocess.Popen(
    [python, "-I", "-B", _BOOT, job_path],
    cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    start_new_session=True, close_fds=True, preexec_fn=functools.partial(_preexec, limits),
  )
  why = None
  try:
    out, err, why = _communicate(proc, stdin, t0 + wall_s, config)
  finally:
    if uid is not None:
      _kill_uid(uid)  # the namespace's PID 1 first: the kernel then kills the rest of it
    try:
      proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
      pass
    _kill_group(proc.pid)
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
      if stream and not stream.closed:
        stream.close()
  wall = time.monotonic() - t0
  stdout = out.decode("utf-8", "replace")
  stderr = err.decode("utf-8", "replace")
  status = _status(proc.returncode, why, stderr, mode, stdout, nonce)
  if mode == "function" and status == "ok":
    stdout = stdout.rstrip("\n")[: -len(nonce)].rstrip("\n")
  return ExecResult(status, proc.returncode, stdout, stderr, wall, proc.pid, uid)


def run_program(
  program: str, *, stdin: str | bytes = b"", timeout_s: float = 6.0, config: SandboxConfig | None = None
) -> ExecResult:
  """Runs the Python source `program` as ``__main__`` in the sandbox.

  Args:
    program: Python source.
    stdin: bytes (or text, UTF-8 encoded) fed to the program's standard input.
    timeout_s: wall-clock limit; the CPU limit is ``ceil(timeout_s) + 1`` seconds.
    config: limits and isolation.

  Raises:
    SandboxError: the sandbox could not be set up (not a fault of the program).
  """
  cfg = config or SandboxConfig()
  data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
  return _run(cfg, "script", program, data, [], timeout_s, timeout_s)


def run_function_tests(
  solution: str, tests: Sequence[str], *, timeout_s: float = 6.0, config: SandboxConfig | None = None
) -> ExecResult:
  """Executes `solution`, then each test snippet (asserts, ``check(f)``) in its namespace.

  Each of the solution and the tests gets its own `timeout_s` alarm; the whole run gets
  ``timeout_s * (len(tests) + 1) + 1`` seconds of wall clock. Status ``ok`` means every test ran
  to the end; a failing assert is ``wrong_answer``; ``sys.exit``/``os._exit`` before the end
  does not count as passing.
  """
  cfg = config or SandboxConfig()
  wall = timeout_s * (len(tests) + 1) + 1.0
  return _run(cfg, "function", solution, b"", list(tests), timeout_s, wall)
