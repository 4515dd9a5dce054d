"""Text of a token stream as it grows: incremental detokenization, and each token's raw bytes.

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen) split one character over several tokens, so the text of
one token decoded alone is often ``U+FFFD``. :class:`IncrementalDetokenizer` is the standard
prefix/read-offset method (as in HF TGI and vLLM): it decodes a short window ``tokens[prefix:]`` and
the part already sent ``tokens[prefix:read]``, and emits the difference only once it does not end in
``U+FFFD`` (an unfinished character); :meth:`IncrementalDetokenizer.flush` emits what is left at the end.
The concatenated output equals ``tokenizer.decode(tokens)`` for decoders that work token by token
(byte-level BPE, sentencepiece with byte fallback, character vocabularies), invalid byte sequences
included (they decode to the same ``U+FFFD`` as in the full text). A decoder that rewrites text across
token boundaries (``clean_up_tokenization_spaces=True``) may differ at those boundaries.

:class:`TokenBytes` gives a token's raw UTF-8 bytes (OpenAI's ``bytes`` log-prob field) and its display
string: for byte-level vocabularies every character of the token maps back to one byte through the
GPT-2 ``bytes_to_unicode`` table; sentencepiece ``<0xHH>`` byte-fallback pieces are that byte and its
word marker ``▁`` a space (``"▁the"`` is ``b" the"``, which a decode of the token alone strips); special
and added tokens are their content; other vocabularies use the decode of the token alone. A token whose bytes are not valid UTF-8 (part of a character) is
shown as ``"bytes:\\xe4\\xbd"``, OpenAI's convention (vLLM shows ``U+FFFD`` there, which loses the bytes).
"""

from __future__ import annotations

import functools
import json
import re

__all__ = ["IncrementalDetokenizer", "TokenBytes", "bytes_to_unicode"]

_REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table used by byte-level BPE vocabularies (256 entries)."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
  chars, extra = {}, 0
  for b in range(256):
    if b in keep:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return chars


class IncrementalDetokenizer:
  """Emits the text of a growing token sequence piece by piece (see the module docstring).

  Example::

      detok = IncrementalDetokenizer(tokenizer)
      deltas = [detok.step(t) for t in tokens] + [detok.flush()]
      assert "".join(deltas) == tokenizer.decode(tokens, skip_special_tokens=True)

  Args:
    tokenizer: a transformers tokenizer (anything with ``decode(ids, skip_special_tokens=...)``).
    skip_special_tokens: passed to every ``decode``.
  """

  def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
    self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
    self.tokens: list[int] = []
    self.prefix_offset = 0  # start of the decode window (a character boundary)
    self.read_offset = 0  # tokens whose text has been emitted
    self.text = ""
    """Everything emitted so far."""

  def _decode(self, ids: list[int]) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

  def _pending(self) -> tuple[str, str]:
    sent = self._decode(self.tokens[self.prefix_offset:self.read_offset])
    window = self._decode(self.tokens[self.prefix_offset:])
    return sent, window

  def step(self, token_id: int) -> str:
    """Adds one token; returns the text it completes ('' while a character is unfinished)."""
    self.tokens.append(int(token_id))
    sent, window = self._pending()
    if len(window) <= len(sent) or window.endswith(_REPLACEMENT):
      return ""
    delta = window[len(sent):]
    self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
    self.text += delta
    return delta

  def flush(self) -> str:
    """The text of the tokens not emitted yet (an unfinished character decodes to ``U+FFFD``, as in the
    full decode); afterwards :attr:`text` equals the decode of every token."""
    sent, window = self._pending()
    delta = window[len(sent):]
    self.prefix_offset = self.read_offset = len(self.tokens)
    self.text += delta
    return delta


def _decoders(tokenizer) -> list[dict]:
  """The fast tokenizer's decoder steps (a ``Sequence`` flattened), as dicts; ``[]`` when there is none."""
  backend = getattr(tokenizer, "backend_tokenizer", None)
  if backend is None:
    return []
  try:
    decoder = json.loads(backend.to_str()).get("decoder") or {}
  except (AttributeError, ValueError, TypeError):
    return []
  found, todo = [], [decoder]
  while todo:
    d = todo.pop()
    if isinstance(d, dict):
      found.append(d)
      todo.extend(d.get("decoders") or [])
  return found


class TokenBytes:
  """``tb(token_id) -> bytes`` (the token's raw bytes) and ``tb.text(token_id)`` (its display string);
  see the module docstring. Results are cached per id."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    steps = _decoders(tokenizer)
    kinds = {d.get("type") for d in steps}
    self.byte_level = "ByteLevel" in kinds
    self.byte_fallback = "ByteFallback" in kinds
    # sentencepiece's word marker: "▁the" is " the" (decoding a token alone would strip that space)
    self.spaces = {d["replacement"]: " " for d in steps if d.get("type") == "Metaspace" and d.get("replacement")}
    self.spaces.update({d["pattern"]["String"]: d.get("content", " ") for d in steps if d.get("type") == "Replace"
                        and isinstance(d.get("pattern"), dict) and d["pattern"].get("String")})
    self._unicode_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    self._added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
    self._cache: dict[int, bytes] = {}

  def __call__(self, token_id: int) -> bytes:
    tid = int(token_id)
    out = self._cache.get(tid)
    if out is None:
      out = self._cache[tid] = self._bytes(tid)
    return out

  def _bytes(self, tid: int) -> bytes:
    if tid in self._added:
      return self._added[tid].encode()
    if self.byte_level or self.byte_fallback or self.spaces:
      piece = self.tokenizer.convert_ids_to_tokens(tid)
      if self.byte_level and piece is not None and all(c in self._unicode_to_byte for c in piece):
        return bytes(self._unicode_to_byte[c] for c in piece)
      match = _BYTE_PIECE.fullmatch(piece or "") if self.byte_fallback else None
      if match:
        return bytes([int(match.group(1), 16)])
      if piece and self.spaces:
        for marker, space in self.spaces.items():
          piece = piece.replace(marker, space)
        return piece.encode()
    return self.tokenizer.decode([tid], skip_special_tokens=False).encode()

  def text(self, token_id: int) -> str:
    """The token as text, or ``"bytes:\\xe4\\xbd"`` when its bytes are not valid UTF-8."""
    raw = self(token_id)
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError:
      return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
