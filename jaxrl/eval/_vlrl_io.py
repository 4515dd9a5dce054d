"""What the vision-language data builders share: input records with their images, OpenAI ``image_url`` parts,
an ordered thread pool over the records, and output files (JSONL plus statistics as JSON and markdown).

A record's ``image`` is a local path, relative to the JSONL file's folder unless absolute; a missing or
unreadable image is a one-line `jaxrl.data.DataError` naming ``file:line``.
"""

from __future__ import annotations

import base64
import json
import mimetypes
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from jaxrl import data as data_lib
from jaxrl.rl import read_records

T = TypeVar("T")
R = TypeVar("R")


def read_image_records(path: str | Path, required: Sequence[str]) -> list[dict[str, Any]]:
  """The records of a JSONL file (a bad line names ``file:line``), each holding the `required` fields, with
  ``image`` resolved to an existing file (stored as ``_image_path``; ``image`` itself is kept as written)."""
  records = read_records([path], check_prompt=False)
  base = Path(path).parent
  for rec in records:
    missing = [k for k in required if k not in rec]
    if missing:
      raise data_lib.DataError(f"{rec['_where']}: missing field(s) {missing}; has keys {sorted(k for k in rec if k[0] != '_')}")
    if "image" in rec:
      if not isinstance(rec["image"], str) or not rec["image"]:
        raise data_lib.DataError(f"{rec['_where']}: 'image' must be a path string, got {rec['image']!r:.80}")
      p = Path(rec["image"])
      p = p if p.is_absolute() else base / p
      if not p.is_file():
        raise data_lib.DataError(f"{rec['_where']}: image not found: {p}")
      rec["_image_path"] = str(p)
  return records


def image_part(path: str, *, where: str = "image") -> dict[str, Any]:
  """An OpenAI chat ``image_url`` content part holding the image file as a base64 data URL."""
  mime = mimetypes.guess_type(path)[0] or "image/png"
  if not mime.startswith("image/"):
    raise data_lib.DataError(f"{where}: {path} does not look like an image (type {mime})")
  try:
    raw = Path(path).read_bytes()
  except OSError as e:
    raise data_lib.DataError(f"{where}: cannot read image {path}: {e.strerror}") from None
  return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(raw).decode()}"}}


def ordered_map(fn: Callable[[T], R], items: Iterable[T], *, workers: int) -> list[R]:
  """``[fn(x) for x in items]`` on `workers` threads (the endpoints' clients bound what is in flight), in order;
  the first exception is raised."""
  items = list(items)
  if workers <= 1:
    return [fn(x) for x in items]
  with ThreadPoolExecutor(max_workers=workers) as pool:
    return list(pool.map(fn, items))


def public(rec: dict[str, Any]) -> dict[str, Any]:
  """A record without the reader's private fields (``_where``, ``_image_path``)."""
  return {k: v for k, v in rec.items() if not k.startswith("_")}


def write_outputs(out: str | Path, rows: Sequence[dict[str, Any]], stats: dict[str, Any], table: str) -> dict[str, str]:
  """Writes `rows` to `out` (JSONL), `stats` to ``<out>.stats.json`` and `table` to ``<out>.stats.md``; returns
  the three paths."""
  out = Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
  stats_path, md_path = out.with_suffix(out.suffix + ".stats.json"), out.with_suffix(out.suffix + ".stats.md")
  stats_path.write_text(json.dumps(stats, indent=2) + "\n")
  md_path.write_text(table + "\n")
  return {"data": str(out), "stats": str(stats_path), "table": str(md_path)}


def markdown_table(title: str, rows: Sequence[tuple[str, Any]]) -> str:
  """A two-column markdown table ``| title | value |``."""
  lines = [f"| {title} | value |", "| --- | ---: |"]
  for name, value in rows:
    lines.append(f"| {name} | {value:.3f} |" if isinstance(value, float) else f"| {name} | {value} |")
  return "\n".join(lines)
