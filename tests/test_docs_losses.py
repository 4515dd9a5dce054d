"""docs/losses.md lists exactly the registry keys of jaxrl.losses, names real functions, embeds real figures."""

import pathlib
import re

import pytest

from jaxrl import losses

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "losses.md"
REGISTRIES = {
    "ADVANTAGES": losses.ADVANTAGES,
    "OBJECTIVES": losses.OBJECTIVES,
    "KL": losses.KL,
    "AGGREGATION_MODES": losses.AGGREGATION_MODES,
    "SFT_LOSSES": losses.SFT_LOSSES,
    "PREFERENCE_LOSSES": losses.PREFERENCE_LOSSES,
}
_UNESCAPED_PIPE = re.compile(r"(?<!\\)\|")
_CODE = re.compile(r"`([^`]+)`")
_LEADING_NAME = re.compile(r"[A-Za-z_]\w*(?=\()")
_FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)


def _code_spans(text: str) -> set[str]:
  """Inline code spans outside fenced blocks, and the name each starts with (`aggregate(...)` -> aggregate)."""
  spans = {span for line in _FENCE.sub("", text).splitlines() for span in _CODE.findall(line)}
  return spans | {m.group(0) for m in map(_LEADING_NAME.match, spans) if m}


def _sections(text: str) -> dict[str, str]:
  """``## heading`` -> the text up to the next ``##`` heading."""
  parts = re.split(r"^## (.+)$", text, flags=re.M)
  return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _first_table(section: str) -> tuple[list[str], list[list[str]]]:
  """Header cells and body rows of the first Markdown table in ``section``."""
  lines = [line.strip() for line in section.splitlines()]
  start = next(i for i, line in enumerate(lines) if line.startswith("|"))
  table = []
  for line in lines[start:]:
    if not line.startswith("|"):
      break
    table.append([cell.strip() for cell in _UNESCAPED_PIPE.split(line.strip("|"))])
  header, _, *rows = table
  assert all(len(row) == len(header) for row in rows), f"ragged table under {header}"
  return header, rows


def _code_name(cell: str) -> str:
  match = _CODE.search(cell)
  assert match, f"no `name` in cell {cell!r}"
  return match.group(1)


def _registry_section(name: str) -> str:
  sections = _sections(DOC.read_text())
  matches = [body for heading, body in sections.items() if heading.endswith(f"`{name}`")]
  assert len(matches) == 1, f"expected one '## ... — `{name}`' section, found {len(matches)}"
  return matches[0]


@pytest.mark.parametrize("registry", sorted(REGISTRIES))
def test_registry_table_lists_exactly_the_keys(registry):
  header, rows = _first_table(_registry_section(registry))
  assert header[0] == "key", header
  keys = [_code_name(row[0]) for row in rows]
  assert len(keys) == len(set(keys)), f"duplicate rows: {keys}"
  assert set(keys) == set(REGISTRIES[registry]), (
      f"missing: {sorted(set(REGISTRIES[registry]) - set(keys))}, "
      f"not in {registry}: {sorted(set(keys) - set(REGISTRIES[registry]))}")


@pytest.mark.parametrize("registry", ["ADVANTAGES", "OBJECTIVES", "SFT_LOSSES"])
def test_function_column_names_the_registered_function(registry):
  header, rows = _first_table(_registry_section(registry))
  col = header.index("function")
  for row in rows:
    key, fn = _code_name(row[0]), _code_name(row[col])
    assert getattr(losses, fn, None) is REGISTRIES[registry][key], f"{registry}[{key!r}] is not losses.{fn}"


def test_every_public_name_is_mentioned():
  mentioned = _code_spans(DOC.read_text())
  missing = sorted(name for name in losses.__all__ if name not in mentioned)
  assert not missing, f"public names of jaxrl.losses missing from {DOC.name}: {missing}"


def test_every_sft_divisor_is_documented():
  mentioned = _code_spans(_registry_section("SFT_LOSSES"))
  assert set(losses.SFT_DIVISORS) <= mentioned


def test_embedded_images_exist():
  images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", DOC.read_text())
  assert len(images) >= 4
  for rel in images:
    assert (DOC.parent / rel).is_file(), rel
