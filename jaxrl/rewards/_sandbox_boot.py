"""The first code that runs inside a sandboxed process (standard library only).

`jaxrl.rewards._sandbox` starts ``python -I -B _sandbox_boot.py JOB.json`` with rlimits already
applied (``preexec_fn``), in a fresh session, with a scrubbed environment and a private temp dir
as cwd. This script reads the job, deletes the job file, sets up the isolation level the job
names, installs a socket-blocking audit hook and then runs the untrusted code:

* ``strong`` (the parent is root): new mount, network and PID namespaces; ``/tmp``,
  ``/var/tmp``, ``/dev/shm``, ``/run/lock`` become the job's own directory; directories closed to
  other users (e.g. ``/root`` holding the interpreter) are covered by an empty tmpfs with only the
  interpreter's directories bound back; a fresh ``/proc``; then the code runs as PID 1 of its
  namespace under a unique unprivileged uid with ``no_new_privs``. This process stays outside as
  root, waits for it and reports its status.
* ``netns`` (unprivileged user namespaces): new user + network namespace, ``no_new_privs``.
* ``basic``: the audit hook only.

Exit codes the parent reads are the ``EXIT_*`` constants below.
"""

import builtins
import ctypes
import json
import os
import signal
import socket
import sys
import traceback

EXIT_SETUP = 120  # the sandbox could not be set up (stderr says why)
EXIT_WRONG = 121  # a function-call test raised AssertionError
EXIT_TIMEOUT = 122  # a function-call test ran past its per-test alarm
EXIT_MEMORY = 123  # MemoryError (RLIMIT_AS)
EXIT_SYNTAX = 124  # the program does not compile
EXIT_SIGNAL_BASE = 160  # strong mode: the code died of signal N -> exit 160 + N
SETUP_MARK = "jaxrl-sandbox-setup-error:"

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38


class _Timeout(BaseException):
  """Raised by the per-test alarm; a BaseException so ``except Exception`` does not swallow it."""


def _libc():
  return ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
  if ret != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, src, target, fstype, flags, data=None):
  enc = lambda s: None if s is None else s.encode()  # noqa: E731
  _check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _setup_strong(job, libc):
  """Namespaces and mounts, as root; returns after fork in the child only (the parent exits)."""
  workdir = job["workdir"]
  _check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID), "unshare")
  _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
  # fds must be opened inside the new mount namespace to be bind sources there
  work_fd = os.open(workdir, os.O_PATH | os.O_DIRECTORY)
  reveal = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in job["reveal"]]
  for d in job["hide"]:
    _mount(libc, "tmpfs", d, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
  for p, fd in reveal:
    os.makedirs(p, exist_ok=True)
    _mount(libc, f"/proc/self/fd/{fd}", p, None, _MS_BIND | _MS_REC)
  for d in job["shadow"]:
    _mount(libc, f"/proc/self/fd/{work_fd}", d, None, _MS_BIND)
  for fd in [work_fd, *(fd for _, fd in reveal)]:
    os.close(fd)
  pid = os.fork()
  if pid:  # outside the namespace: wait and report, never run user code
    while True:
      try:
        _, status = os.waitpid(pid, 0)
        break
      except ChildProcessError:
        os._exit(EXIT_SETUP)
      except InterruptedError:
        continue
    if os.WIFSIGNALED(status):
      os._exit(EXIT_SIGNAL_BASE + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))
  _mount(libc, "proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
  os.chdir(job["home"])
  uid = job["uid"]
  os.setgroups([])
  os.setresgid(uid, uid, uid)
  os.setresuid(uid, uid, uid)
  _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
  _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(pdeathsig)")


def _setup_netns(libc):
  _check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET), "unshare(user+net)")
  _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")


def _audit_hook(event, args):
  if event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
    if getattr(args[0], "family", None) in (socket.AF_INET, socket.AF_INET6):
      raise PermissionError(f"{event}: network access is disabled in the jaxrl sandbox")
  elif event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr"):
    raise PermissionError(f"{event}: network access is disabled in the jaxrl sandbox")


def _alarm(signum, frame):
  raise _Timeout()


def _compile(path):
  with open(path, encoding="utf-8") as f:
    src = f.read()
  try:
    return compile(src, os.path.basename(path), "exec")
  except (SyntaxError, ValueError):
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(EXIT_SYNTAX)


def _run_script(path):
  code = _compile(path)
  sys.argv = [os.path.basename(path)]
  sys.path.insert(0, os.getcwd())
  g = {"__name__": "__main__", "__file__": os.path.abspath(path), "__builtins__": builtins}
  try:
    exec(code, g)
  except MemoryError:
    _die(EXIT_MEMORY)
  except SystemExit:
    raise
  except BaseException:  # noqa: BLE001 (report like the interpreter, exit 1)
    _die(1)


def _run_function_tests(path, tests, per_test_s, nonce):
  signal.signal(signal.SIGALRM, _alarm)
  code = _compile(path)
  sys.argv = [os.path.basename(path)]
  sys.path.insert(0, os.getcwd())
  g = {"__name__": "solution", "__builtins__": builtins}
  compiled = []
  for i, t in enumerate(tests):
    try:
      compiled.append(compile(t, f"test_{i}", "exec"))
    except (SyntaxError, ValueError):
      traceback.print_exc()
      _die(EXIT_SETUP, f"test {i} does not compile")
  for i, c in enumerate([code, *compiled]):
    signal.setitimer(signal.ITIMER_REAL, per_test_s)
    try:
      exec(c, g)
    except _Timeout:
      _die(EXIT_TIMEOUT, f"{'solution' if i == 0 else f'test {i - 1}'} timed out")
    except AssertionError:
      _die(EXIT_WRONG, None if i == 0 else f"test {i - 1} failed")
    except MemoryError:
      _die(EXIT_MEMORY)
    except BaseException:  # noqa: BLE001 (SystemExit included: a solution may not end the run)
      _die(1)
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
  try:
    sys.stdout.flush()
  finally:
    os.write(1, f"\n{nonce}\n".encode())
    os._exit(0)


def _die(code, note=None):
  traceback.print_exc()
  if note:
    print(f"jaxrl-sandbox: {note}", file=sys.stderr)
  try:
    sys.stdout.flush()
    sys.stderr.flush()
  finally:
    os._exit(code)


def main():
  job_path = sys.argv[1]
  try:
    with open(job_path, encoding="utf-8") as f:
      job = json.load(f)
    os.unlink(job_path)
    level = job["isolation"]
    if level == "strong":
      _setup_strong(job, _libc())
    elif level == "netns":
      _setup_netns(_libc())
    elif level != "basic":
      raise ValueError(f"unknown isolation {level!r}")
    sys.addaudithook(_audit_hook)
  except Exception as e:  # noqa: BLE001 (any setup failure is reported to the parent)
    print(f"{SETUP_MARK} {type(e).__name__}: {e}", file=sys.stderr)
    sys.stderr.flush()
    os._exit(EXIT_SETUP)
  if job["mode"] == "function":
    _run_function_tests(job["program"], job["tests"], job["per_test_s"], job["nonce"])
  else:
    _run_script(job["program"])


if __name__ == "__main__":
  main()
