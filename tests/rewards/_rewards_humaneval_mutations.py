"""Deterministic mutations of HumanEval canonical solutions (for the peer check)."""

import io
import re
import tokenize

_SWAP = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


def _tokens(src):
  return list(tokenize.generate_tokens(io.StringIO(src).readline))


def _replace_token(src, tok, text):
  lines = src.splitlines(keepends=True)
  (row, col), (erow, ecol) = tok.start, tok.end
  assert row == erow
  line = lines[row - 1]
  lines[row - 1] = line[:col] + text + line[ecol:]
  return "".join(lines)


def return_none(src):
  out = re.sub(r"(?m)^(\s*)return\b.*$", r"\1return None", src)
  return out if out != src else None


def off_by_one(src):
  try:
    toks = _tokens(src)
  except (tokenize.TokenError, IndentationError):
    return None
  for tok in toks:
    if tok.type == tokenize.NUMBER and re.fullmatch(r"\d+", tok.string):
      return _replace_token(src, tok, str(int(tok.string) + 1))
  return None


def swap_comparison(src):
  try:
    toks = _tokens(src)
  except (tokenize.TokenError, IndentationError):
    return None
  for tok in toks:
    if tok.type == tokenize.OP and tok.string in _SWAP:
      return _replace_token(src, tok, _SWAP[tok.string])
  return None


def drop_last_line(src):
  lines = src.rstrip("\n").splitlines()
  while lines and not lines[-1].strip():
    lines.pop()
  if len(lines) < 2:
    return None
  return "\n".join(lines[:-1]) + "\n"


MUTATIONS = {
  "return_none": return_none,
  "off_by_one": off_by_one,
  "swap_comparison": swap_comparison,
  "drop_last_line": drop_last_line,
}
