"""The layer order of ``jaxrl`` (docs/design.md), checked from the source with ``ast``.

Every module under ``jaxrl/`` is parsed; each import of a ``jaxrl`` module (at module level or inside a
function) must point down the order or stay inside its own package, modules must import each other in
no cycle (imports inside functions count: one that closes a cycle only hides it), and an import of a
``jaxrl`` module inside a function must say why on its line with a ``# lazy: <reason>`` comment (the only
accepted reason: it keeps a heavy or optional dependency, or a command's whole stack, off an import path
that does not need it; never to dodge a cycle).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, ...], ...] = (
    ("", "config", "targets", "_cache", "_platform", "_extras", "_compile_target", "_host_memory"),
    ("sharding",),
    ("kernels",),
    ("models",),
    ("losses", "data"),
    ("sampling",),
    ("rewards",),
    ("train",),
    ("sft", "latent", "pref"),
    ("rl",),
    ("envs",),
    ("recipes", "plan", "eval", "serve", "bench", "quickstart", "info"),
    ("cli",),
)
"""Bottom to top: a module may import its own package and the packages of its layer or of a layer below.
``""`` is the root ``jaxrl/__init__.py``; a name is a subpackage or a top-level module of ``jaxrl``."""

LAZY = re.compile(r"#\s*lazy:\s*\S")
"""The comment a function-level ``jaxrl`` import carries on one of its lines: ``# lazy: <reason>``."""


@dataclasses.dataclass(frozen=True)
class Import:
  """One import of a package module: who imports what, where, and whether it runs at module import."""

  source: str
  target: str
  path: str
  line: int
  in_function: bool
  type_checking: bool
  lazy_reason: bool

  def __str__(self) -> str:
    where = "in a function" if self.in_function else "module level"
    return f"{self.path}:{self.line}: {self.source} imports {self.target} ({where})"


def module_names(root: Path, package: str) -> dict[str, Path]:
  """Dotted module name -> file, for every ``.py`` file of ``root/package``."""
  out = {}
  for path in sorted((root / package).rglob("*.py")):
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def _is_type_checking(node: ast.If) -> bool:
  test = node.test
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
      isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, in_function: bool, type_checking: bool):
  """``(import node, in_function, type_checking)`` for every import under ``node``."""
  for child in ast.iter_child_nodes(node):
    if isinstance(child, (ast.Import, ast.ImportFrom)):
      yield child, in_function, type_checking
    elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      yield from _walk(child, True, type_checking)
    elif isinstance(child, ast.If) and _is_type_checking(child):
      yield from _walk(child, in_function, True)
    else:
      yield from _walk(child, in_function, type_checking)


def _resolve(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict) -> list[str]:
  """The package modules an import statement loads (a ``from X import name`` of a submodule names it)."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names if a.name in modules or a.name.split(".")[0] in modules]
  base = node.module or ""
  if node.level:
    here = module.split(".") if is_package else module.split(".")[:-1]
    here = here[:len(here) - node.level + 1]
    base = ".".join(here + ([base] if base else []))
  if base not in modules:
    return []
  subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
  return subs if len(subs) == len(node.names) else [base, *subs]


def scan(root: Path, package: str) -> list[Import]:
  """Every import, anywhere in the files of ``root/package``, of a module of that package."""
  modules = module_names(root, package)
  out = []
  for module, path in modules.items():
    source = path.read_text()
    lines = source.splitlines()
    for node, in_function, type_checking in _walk(ast.parse(source, str(path)), False, False):
      text = "\n".join(lines[node.lineno - 1:node.end_lineno])
      for target in _resolve(node, module, path.name == "__init__.py", modules):
        out.append(Import(source=module, target=target, path=str(path.relative_to(root)), line=node.lineno,
                          in_function=in_function, type_checking=type_checking,
                          lazy_reason=bool(LAZY.search(text))))
  return out


def layer_of(module: str, package: str, layers=LAYERS) -> tuple[int, str]:
  """``(layer index, unit name)`` of a dotted module: its subpackage or top-level module under ``package``."""
  parts = module.split(".")
  unit = parts[1] if len(parts) > 1 else ""
  for i, names in enumerate(layers):
    if unit in names:
      return i, unit
  raise KeyError(f"{module}: {unit!r} is in no layer; add it to LAYERS (tests/test_layers.py) and docs/design.md")


def order_violations(imports: list[Import], package: str, layers=LAYERS) -> list[Import]:
  """Imports from a lower layer of a higher one (module level or in a function)."""
  bad = []
  for imp in imports:
    (src_layer, src_unit), (dst_layer, dst_unit) = layer_of(imp.source, package, layers), layer_of(
        imp.target, package, layers)
    if src_unit != dst_unit and dst_layer > src_layer:
      bad.append(imp)
  return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one node (or a self-loop), each sorted (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1 or v in edges.get(v, ()):
        out.append(sorted(comp))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


def module_cycles(imports: list[Import]) -> list[list[str]]:
  """Cycles among modules, counting imports inside functions too (one that closes a cycle only hides it);
  imports under ``if TYPE_CHECKING:`` never run and are not counted."""
  edges: dict[str, set[str]] = {}
  for imp in imports:
    if not imp.type_checking and imp.source != imp.target:
      edges.setdefault(imp.source, set()).add(imp.target)
  return cycles(edges)


def unexplained_lazy(imports: list[Import]) -> list[Import]:
  """Function-level imports of package modules without a ``# lazy: <reason>`` comment."""
  return [imp for imp in imports if imp.in_function and not imp.lazy_reason]


def private_reach(imports: list[Import]) -> list[Import]:
  """Imports of another unit's private module (``jaxrl.X._y`` from outside ``jaxrl.X``): a package is
  used through what its ``__init__`` exports."""
  bad = []
  for imp in imports:
    src, dst = imp.source.split("."), imp.target.split(".")
    if len(dst) >= 3 and dst[2].startswith("_") and (len(src) < 2 or src[1] != dst[1]):
      bad.append(imp)
  return bad


def report(imports: list[Import], package: str, layers=LAYERS) -> str:
  """Every violation, one per line, grouped by rule; empty when the package keeps its layers."""
  out = [f"against the layer order: {imp}" for imp in order_violations(imports, package, layers)]
  out += ["import cycle: " + " -> ".join(c) for c in module_cycles(imports)]
  out += [f"function-level import without '# lazy: <reason>': {imp}" for imp in unexplained_lazy(imports)]
  out += [f"private module of another package: {imp}" for imp in private_reach(imports)]
  return "\n".join(out)


def test_every_module_has_a_layer():
  for module in module_names(ROOT, "jaxrl"):
    layer_of(module, "jaxrl")


def test_imports_follow_the_layer_order():
  bad = order_violations(scan(ROOT, "jaxrl"), "jaxrl")
  assert not bad, "imports against the layer order (docs/design.md):\n" + "\n".join(map(str, bad))


def test_no_import_cycle():
  found = module_cycles(scan(ROOT, "jaxrl"))
  assert not found, "import cycles between modules:\n" + "\n".join(" -> ".join(c) for c in found)


def test_function_level_imports_say_why():
  bad = unexplained_lazy(scan(ROOT, "jaxrl"))
  assert not bad, ("function-level jaxrl imports need '# lazy: <reason>' (a heavy or optional dependency kept "
                   "off an import path; never a cycle):\n" + "\n".join(map(str, bad)))


def test_packages_are_used_through_their_public_names():
  bad = private_reach(scan(ROOT, "jaxrl"))
  assert not bad, "imports of another package's private module (use its __init__ exports):\n" + "\n".join(
      map(str, bad))


def test_the_checker_finds_an_upward_import_a_cycle_and_an_unexplained_lazy_import(tmp_path):
  files = {
      "pkg/__init__.py": "",
      "pkg/low/__init__.py": "",
      "pkg/low/_a.py": "from pkg.low import _b\n",
      "pkg/low/_b.py": "def f():\n  from . import _a  # lazy: hides the cycle\n  from pkg import high  # lazy: keeps it off\n",
      "pkg/high/__init__.py": "",
      "pkg/high/_ok.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from pkg.high import _user\n\n"
                         "def g():\n  import pkg.low._b\n",
      "pkg/high/_user.py": "from pkg.high import _ok\n",
      "pkg/high/_reach.py": "from pkg.low._b import f\n",
  }
  for name, text in files.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(textwrap.dedent(text))
  layers = (("",), ("low",), ("high",))
  imports = scan(tmp_path, "pkg")
  assert [(i.path, i.line, i.target) for i in order_violations(imports, "pkg", layers)] == [
      ("pkg/low/_b.py", 3, "pkg.high")]
  assert module_cycles(imports) == [["pkg.low._a", "pkg.low._b"]]
  assert [(i.path, i.line) for i in unexplained_lazy(imports)] == [("pkg/high/_ok.py", 6)]
  text = report(imports, "pkg", layers)
  assert "pkg/low/_b.py:3: pkg.low._b imports pkg.high (in a function)" in text
  assert "import cycle: pkg.low._a -> pkg.low._b" in text
  assert "pkg/high/_ok.py:6" in text
  assert not order_violations(imports, "pkg", (("",), ("low", "high")))  # one layer: no order to break
  assert [(i.path, i.target) for i in private_reach(imports)] == [("pkg/high/_ok.py", "pkg.low._b"),
                                                                  ("pkg/high/_reach.py", "pkg.low._b")]
