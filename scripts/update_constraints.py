"""Writes requirements/constraints.txt: the exact versions of jaxrl's dependency closure in this venv.

Run it from a venv where ``pip install -e ".[test]"`` (plus any extras you use) resolved fresh and the
test suite passed; it pins every installed distribution that the requirements in pyproject.toml reach
(``dependencies`` and every optional extra; one whose packages are not installed here is skipped, and a
constraint never installs anything by itself). Usage::

    .venv/bin/python scripts/update_constraints.py > requirements/constraints.txt
"""

from __future__ import annotations

import importlib.metadata as md
import pathlib
import re
import sys
import tomllib

from packaging.requirements import Requirement


def _canon(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def roots(pyproject: pathlib.Path) -> list[Requirement]:
  """Every requirement of ``pyproject.toml``: dependencies and all optional extras."""
  project = tomllib.loads(pyproject.read_text())["project"]
  reqs = list(project.get("dependencies", []))
  for extra in project.get("optional-dependencies", {}).values():
    reqs += extra
  return [Requirement(r) for r in reqs]


def closure(reqs: list[Requirement]) -> dict[str, str]:
  """``{name: version}`` of the installed distributions that ``reqs`` reach, recursively."""
  todo = [(r.name, set(r.extras)) for r in reqs]
  seen: dict[str, set[str]] = {}
  found: dict[str, str] = {}
  while todo:
    name, extras = todo.pop()
    key = _canon(name)
    if key in seen and extras <= seen[key]:
      continue
    seen.setdefault(key, set()).update(extras)
    try:
      d = md.distribution(name)
    except md.PackageNotFoundError:
      continue  # an optional package that is not installed here
    found[d.metadata["Name"]] = d.version
    for raw in d.requires or []:
      req = Requirement(raw)
      envs = [{"extra": e} for e in extras] or [{"extra": ""}]
      if req.marker is None or any(req.marker.evaluate(env) for env in envs):
        todo.append((req.name, set(req.extras)))
  return found


def main() -> int:
  pins = closure(roots(pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"))
  print("# Tested versions of jaxrl's dependencies (all extras); install with")
  print('#   pip install -c requirements/constraints.txt -e ".[test]"')
  print("# Regenerate with scripts/update_constraints.py (README: Reproducible installs).")
  for name in sorted(pins, key=_canon):
    print(f"{name}=={pins[name]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
