"""Hugging Face checkpoint interop: load/save safetensors directories, tokenizers.

Loading never materialises a full unsharded copy: the module is built abstractly
(:func:`flax.nnx.eval_shape`), and every parameter is created with
:func:`jax.make_array_from_callback` on its target ``NamedSharding``; the callback reads only the
slice a device needs from the safetensors file (``safe_open(...).get_slice``). On several hosts each
process therefore reads what its own devices hold.

HF stores ``nn.Linear`` weights as ``[out, in]``; this model keeps ``[in, out]`` with heads split
out (``q_proj [D, N, H]``, ``o_proj [N, H, D]``), and stacks the blocks on a leading ``layers`` axis
when ``scan_layers``. :data:`_LAYOUTS` records each parameter's HF name and the reshape/transpose
between the two layouts.

A vision-language model (Qwen2.5-VL, Qwen2-VL) is written in the hub's layout: the language model under
``model.*`` / ``lm_head.weight`` as for Qwen2, the tower under ``visual.*`` (:data:`VISION_HF_LAYOUTS`).
transformers 5 saves ``model.language_model.*`` / ``model.visual.*`` instead; loading reads both.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy reader needs)
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl.models._config import ModelConfig
from jaxrl.models._placement import _set_placement, abstract_model, state_shardings
from jaxrl.models._transformer import Transformer
from jaxrl.models._vision import VISION_HF_LAYOUTS
from jaxrl.sharding import LogicalRules

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


# --------------------------------------------------------------------------------------------------
# Layout of every parameter relative to its HF tensor


@dataclasses.dataclass(frozen=True)
class _Layout:
  """``ours = reshape(hf, split).transpose(perm)``; HF dim ``i`` is the merge of ``groups[i]`` split dims.

  Example: ``q_proj`` is HF ``[N·H, D]``; split ``[N, H, D]`` (groups ``(2, 1)``); ours
  ``[D, N, H]`` = split axes ``perm = (2, 0, 1)``.
  """

  hf_name: str  # may contain {i} (layer index)
  groups: tuple[int, ...]
  perm: tuple[int, ...]

  def split_shape(self, ours: Sequence[int]) -> tuple[int, ...]:
    split = [0] * len(ours)
    for j, p in enumerate(self.perm):
      split[p] = ours[j]
    return tuple(split)

  def hf_shape(self, ours: Sequence[int]) -> tuple[int, ...]:
    split = self.split_shape(ours)
    shape, i = [], 0
    for g in self.groups:
      shape.append(math.prod(split[i:i + g]))
      i += g
    return tuple(shape)

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    """Our per-layer array -> the HF tensor."""
    split = np.transpose(x, np.argsort(self.perm))
    return np.ascontiguousarray(split.reshape(self.hf_shape(x.shape)))

  def read(self, read_hf: Callable[[tuple[slice, ...]], np.ndarray], ours: Sequence[int],
           index: Sequence[slice]) -> np.ndarray:
    """Our per-layer slice ``index`` (one slice per our dim), reading only the HF rows it covers."""
    split = self.split_shape(ours)
    split_index = [None] * len(ours)
    for j, p in enumerate(self.perm):
      split_index[p] = slice(*index[j].indices(ours[j]))
    hf_index, inner_index, block_shape, i = [], [], [], 0
    for g in self.groups:
      inner = math.prod(split[i + 1:i + g])
      outer = split_index[i]
      hf_index.append(slice(outer.start * inner, outer.stop * inner))
      block_shape += [outer.stop - outer.start, *split[i + 1:i + g]]
      inner_index += [slice(None), *split_index[i + 1:i + g]]
      i += g
    block = read_hf(tuple(hf_index)).reshape(block_shape)[tuple(inner_index)]
    return np.transpose(block, self.perm)


_IDENTITY1 = ((1,), (0,))
_T2 = ((1, 1), (1, 0))
# Paths inside one block -> layout. Keys are nnx state paths relative to the block.
_BLOCK_LAYOUTS: dict[tuple[str, ...], _Layout] = {
    ("attn_norm", "scale"): _Layout("model.layers.{i}.input_layernorm.weight", *_IDENTITY1),
    ("attn", "q_proj"): _Layout("model.layers.{i}.self_attn.q_proj.weight", (2, 1), (2, 0, 1)),
    ("attn", "k_proj"): _Layout("model.layers.{i}.self_attn.k_proj.weight", (2, 1), (2, 0, 1)),
    ("attn", "v_proj"): _Layout("model.layers.{i}.self_attn.v_proj.weight", (2, 1), (2, 0, 1)),
    ("attn", "o_proj"): _Layout("model.layers.{i}.self_attn.o_proj.weight", (1, 2), (1, 2, 0)),
    ("attn", "q_bias"): _Layout("model.layers.{i}.self_attn.q_proj.bias", (2,), (0, 1)),
    ("attn", "k_bias"): _Layout("model.layers.{i}.self_attn.k_proj.bias", (2,), (0, 1)),
    ("attn", "v_bias"): _Layout("model.layers.{i}.self_attn.v_proj.bias", (2,), (0, 1)),
    ("attn", "q_norm", "scale"): _Layout("model.layers.{i}.self_attn.q_norm.weight", *_IDENTITY1),
    ("attn", "k_norm", "scale"): _Layout("model.layers.{i}.self_attn.k_norm.weight", *_IDENTITY1),
    ("mlp_norm", "scale"): _Layout("model.layers.{i}.post_attention_layernorm.weight", *_IDENTITY1),
    ("mlp", "gate_proj"): _Layout("model.layers.{i}.mlp.gate_proj.weight", *_T2),
    ("mlp", "up_proj"): _Layout("model.layers.{i}.mlp.up_proj.weight", *_T2),
    ("mlp", "down_proj"): _Layout("model.layers.{i}.mlp.down_proj.weight", *_T2),
}
_TOP_LAYOUTS: dict[tuple[str, ...], _Layout] = {
    ("embed",): _Layout("model.embed_tokens.weight", (1, 1), (0, 1)),
    ("final_norm", "scale"): _Layout("model.norm.weight", *_IDENTITY1),
    ("lm_head",): _Layout("lm_head.weight", *_T2),
}


VISUAL_PREFIX = "visual."
"""Hub prefix of the vision tower's tensors (transformers 5 writes ``model.visual.``)."""
_VISION_TOP = {path: _Layout(VISUAL_PREFIX + name, tuple(g), tuple(p))
               for path, (name, g, p) in VISION_HF_LAYOUTS.items() if "{i}" not in name}
_VISION_BLOCK = {path: _Layout(VISUAL_PREFIX + name, tuple(g), tuple(p))
                 for path, (name, g, p) in VISION_HF_LAYOUTS.items() if "{i}" in name}


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One model parameter: its state path, layout and which HF layer(s) it holds."""

  path: tuple
  layout: _Layout
  stacked: bool  # leading axis is `layers` (scan_layers)
  layer: int | None  # layer index for an unstacked block parameter
  count: int = 0  # blocks on the stacked axis (language model or vision tower)

  def hf_names(self) -> list[str]:
    if self.stacked:
      return [self.layout.hf_name.format(i=i) for i in range(self.count)]
    return [self.layout.hf_name.format(i=self.layer)]


def _entry(path: tuple, cfg: ModelConfig) -> _Entry:
  parts = tuple(path)
  count, stacked, layer = cfg.num_layers, False, None
  if parts and parts[0] == "visual" and cfg.vision is not None:
    count = cfg.vision.depth
    layout = _VISION_TOP.get(parts[1:])
    if layout is None and len(parts) > 2:  # parts[1] holds the blocks
      rel, stacked = (parts[2:], True) if cfg.scan_layers else (parts[3:], False)
      layer = None if stacked else int(parts[2])
      layout = _VISION_BLOCK.get(tuple(rel))
  elif parts and parts[0] == "layers":
    if cfg.scan_layers:
      rel, stacked = parts[1:], True
    else:
      rel, layer = parts[2:], int(parts[1])
    layout = _BLOCK_LAYOUTS.get(tuple(rel))
  else:
    layout = _TOP_LAYOUTS.get(parts)
  if layout is None:
    raise KeyError(f"parameter {'/'.join(map(str, parts))} has no Hugging Face name")
  return _Entry(parts, layout, stacked, layer, count)


def _entries(state: nnx.State, cfg: ModelConfig) -> list[tuple[_Entry, nnx.Variable]]:
  return [(_entry(path, cfg), var) for path, var in nnx.to_flat_state(state)]


# --------------------------------------------------------------------------------------------------
# Reading safetensors


class _Checkpoint:
  """The tensors of a local HF directory (one ``model.safetensors`` or an indexed set of shards).

  With ``vl``, transformers 5's VLM names (``model.language_model.*``, ``model.visual.*``) are read under
  their hub names (``model.*``, ``visual.*``), so the rest of the loader sees one layout.
  """

  def __init__(self, path: Path, *, vl: bool = False):
    self.path = path
    index_file = path / SAFETENSORS_INDEX
    if index_file.exists():
      with open(index_file) as f:
        index = json.load(f)
      if "weight_map" not in index:
        raise ValueError(f"{index_file}: no 'weight_map' key")
      self.weight_map: dict[str, str] = dict(index["weight_map"])
      for key, fname in sorted(self.weight_map.items()):
        if not (path / fname).exists():
          raise FileNotFoundError(
              f"{index_file} maps tensor {key!r} to shard {fname!r}, but {path / fname} does not exist")
      files = sorted(set(self.weight_map.values()))
    elif (path / SAFETENSORS_FILE).exists():
      files = [SAFETENSORS_FILE]
      self.weight_map = None
    else:
      raise FileNotFoundError(
          f"{path}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} (only safetensors checkpoints are supported)")
    self._handles = {fname: safe_open(str(path / fname), framework="np") for fname in files}
    if self.weight_map is None:
      self.weight_map = {k: SAFETENSORS_FILE for k in self._handles[SAFETENSORS_FILE].keys()}
    else:
      for fname, handle in self._handles.items():
        present = set(handle.keys())
        for key in (k for k, f in self.weight_map.items() if f == fname):
          if key not in present:
            raise KeyError(f"{index_file} maps tensor {key!r} to {fname!r}, but that shard does not contain it")
    self.stored = {k: k for k in self.weight_map}  # hub name -> name in the files
    if vl:
      self.stored = _hub_names(self.weight_map, path)
      self.weight_map = {hub: self.weight_map[k] for hub, k in self.stored.items()}

  def keys(self) -> set[str]:
    return set(self.weight_map)

  def where(self, key: str) -> str:
    return str(self.path / self.weight_map[key])

  def _slice(self, key: str):
    if key not in self.weight_map:
      raise KeyError(f"{self.path}: checkpoint has no tensor {key!r}")
    return self._handles[self.weight_map[key]].get_slice(self.stored[key])

  def shape(self, key: str) -> tuple[int, ...]:
    return tuple(self._slice(key).get_shape())

  def read(self, key: str, index: tuple[slice, ...]) -> np.ndarray:
    return np.asarray(self._slice(key)[index])


_T5_PREFIXES = (("model.language_model.", "model."), ("model.visual.", VISUAL_PREFIX))


def _hub_names(weight_map: Mapping[str, str], path: Path) -> dict[str, str]:
  """Hub name -> stored name of a VLM checkpoint's tensors (either layout; a mix of both is refused)."""
  out = {}
  for key in weight_map:
    hub = key
    for t5, prefix in _T5_PREFIXES:
      if key.startswith(t5):
        hub = prefix + key[len(t5):]
    if hub in out:
      raise ValueError(f"{path}: tensors {out[hub]!r} and {key!r} are both {hub!r} (the hub and the transformers-5 "
                       "layouts mixed)")
    out[hub] = key
  return out


def _read_config(path: Path) -> dict[str, Any]:
  cfg_file = path / "config.json"
  if not cfg_file.exists():
    raise FileNotFoundError(f"{path}: no config.json (is this a Hugging Face model directory?)")
  with open(cfg_file) as f:
    return json.load(f)


def _checkpoint_dtype(hf: Mapping[str, Any]) -> str:
  name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  return "bfloat16" if name == "bfloat16" else "float32"


def config_from_dir(path: str | os.PathLike, *, dtype: str | None = None, param_dtype: str | None = None,
                    **config_overrides) -> ModelConfig:
  """The :class:`ModelConfig` :func:`load_pretrained` builds for a local HF directory (reads only
  ``config.json``).

  Args:
    path: the directory.
    dtype: compute dtype; default the checkpoint's (``bfloat16`` if its ``config.json`` says so,
      else ``float32``).
    param_dtype: storage dtype of the parameters; default ``float32`` whatever ``dtype`` is: the
      trained master weights and their optimizer state stay float32, bf16 is a compute dtype.
    **config_overrides: further :class:`ModelConfig` fields.
  """
  path = Path(path)
  hf = _read_config(path)
  return ModelConfig.from_hf_config(hf, source=str(path / "config.json"), dtype=dtype or _checkpoint_dtype(hf),
                                    param_dtype=param_dtype or "float32", **config_overrides)


def load_pretrained(
    path: str | os.PathLike,
    *,
    mesh: Mesh | None = None,
    dtype: str | None = None,
    param_dtype: str | None = None,
    rules: LogicalRules | None = None,
    tokenizer=None,
    **config_overrides,
) -> Transformer:
  """Loads a local Hugging Face Llama/Qwen2/Qwen3 directory into a (sharded) :class:`Transformer`.

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` or ``model.safetensors.index.json``
      plus shards (bfloat16, float16 or float32 on disk).
    mesh: place every parameter with its ``NamedSharding`` from ``rules`` on this mesh (the model
      then holds a :class:`Placement`); default one device.
    dtype: compute dtype; default the checkpoint's (float32 unless its config says bfloat16).
    param_dtype: storage dtype; default float32 whatever ``dtype`` is (see :func:`config_from_dir`).
    rules: logical-to-mesh rules (default :meth:`LogicalRules.default`).
    tokenizer: if given, checked against the embedding size (:func:`check_tokenizer`).
    **config_overrides: :class:`ModelConfig` fields to change (``scan_layers``, ``remat``,
      ``attention_impl``, ...).

  Returns:
    The model, with every array already on its devices.
  """
  path = Path(path)
  cfg = config_from_dir(path, dtype=dtype, param_dtype=param_dtype, **config_overrides)
  if tokenizer is not None:
    check_tokenizer(tokenizer, cfg)
  ckpt = _Checkpoint(path, vl=cfg.vision is not None)
  graphdef, abs_state = nnx.split(abstract_model(cfg))
  entries = _entries(abs_state, cfg)

  expected = {}
  for entry, var in entries:
    shape = var.shape[1:] if entry.stacked else var.shape
    for name in entry.hf_names():
      expected[name] = entry.layout.hf_shape(shape)
  for name, shape in sorted(expected.items(), key=lambda kv: _hf_order(kv[0])):
    if name not in ckpt.weight_map:
      raise KeyError(f"{path}: checkpoint has no tensor {name!r} (required by config.json: "
                     f"model_type={cfg.model_type!r}, num_layers={cfg.num_layers}, "
                     f"tie_word_embeddings={cfg.tie_word_embeddings})")
    got = ckpt.shape(name)
    if got != shape:
      raise ValueError(f"{ckpt.where(name)}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                       "from config.json")
  ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
  unexpected = sorted(k for k in ckpt.keys() - expected.keys() - ignorable if not k.endswith("rotary_emb.inv_freq"))
  if unexpected:
    raise ValueError(f"{path}: checkpoint tensors not used by a {cfg.model_type} model: {unexpected[:8]}"
                     + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else ""))

  shardings = dict(nnx.to_flat_state(state_shardings(abs_state, mesh, rules)))
  np_dtype = _NP_DTYPES[cfg.param_dtype]
  loaded = []
  for entry, var in entries:
    sharding = shardings[entry.path].get_value()
    loaded.append((entry.path, var.replace(_load_array(ckpt, entry, var.shape, sharding, np_dtype))))
  return _set_placement(nnx.merge(graphdef, nnx.from_flat_state(loaded)), mesh, rules)


def _load_array(ckpt: _Checkpoint, entry: _Entry, shape, sharding, np_dtype) -> jax.Array:
  names = entry.hf_names()
  memo: dict[tuple, np.ndarray] = {}

  def callback(index):
    index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))
    key = tuple((s.start, s.stop) for s in index)
    if key not in memo:
      if entry.stacked:
        layer_shape = shape[1:]
        parts = [entry.layout.read(lambda i, n=names[l]: ckpt.read(n, i), layer_shape, index[1:])
                 for l in range(*index[0].indices(shape[0]))]
        memo[key] = np.stack(parts).astype(np_dtype)
      else:
        memo[key] = entry.layout.read(lambda i: ckpt.read(names[0], i), shape, index).astype(np_dtype)
    return memo[key]

  return jax.make_array_from_callback(tuple(shape), sharding, callback, dtype=np_dtype)


# --------------------------------------------------------------------------------------------------
# Saving


@jax.jit
def _layer(x: jax.Array, i: jax.Array) -> jax.Array:
  return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _host_array(x: jax.Array, layer: int | None) -> np.ndarray:
  """``x`` (or its ``layer``-th slice, cut on device) as a host array, gathered across processes."""
  if layer is not None:
    x = _layer(x, jnp.asarray(layer, jnp.int32))
  if not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def save_pretrained(
    model: Transformer,
    path: str | os.PathLike,
    *,
    tokenizer=None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: str | None = None,
    generation_config: Mapping[str, Any] | None = None,
) -> None:
  """Writes a directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads (a VLM:
  ``AutoModelForImageTextToText``, in the hub layout).

  Files: ``config.json``; ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards plus
  ``model.safetensors.index.json`` when the tensors exceed ``max_shard_bytes``; the tokenizer's files
  if ``tokenizer`` is given (checked with :func:`check_tokenizer`); ``generation_config.json`` if
  ``generation_config`` is given. On several hosts every process must call this (arrays are
  gathered); only process 0 writes.

  Args:
    model: the model (any sharding).
    path: output directory (created).
    tokenizer: a transformers tokenizer to save alongside.
    max_shard_bytes: largest safetensors file before splitting.
    dtype: storage dtype ('float32' or 'bfloat16'); default the model's ``param_dtype``.
    generation_config: keys for ``generation_config.json``.
  """
  cfg = model.cfg
  dtype = dtype or cfg.param_dtype
  if dtype not in _NP_DTYPES:
    raise ValueError(f"dtype: {dtype!r} is not one of {list(_NP_DTYPES)}")
  if tokenizer is not None:
    check_tokenizer(tokenizer, cfg)
  if max_shard_bytes <= 0:
    raise ValueError(f"max_shard_bytes: must be positive, got {max_shard_bytes!r}")
  np_dtype = _NP_DTYPES[dtype]
  shards = _shard_plan(nnx.state(model), cfg, itemsize=np.dtype(np_dtype).itemsize, max_shard_bytes=max_shard_bytes)
  writer = jax.process_index() == 0
  path = Path(path)
  if writer:
    path.mkdir(parents=True, exist_ok=True)
  weight_map = _write_shards(shards, path, np_dtype, writer=writer)
  if not writer:
    return
  _write_index(path, shards, weight_map)
  with open(path / "config.json", "w") as f:
    json.dump(_hf_config(cfg, dtype, tokenizer), f, indent=2)
  if generation_config is not None:
    with open(path / "generation_config.json", "w") as f:
      json.dump(dict(generation_config), f, indent=2)
  if tokenizer is not None:
    tokenizer.save_pretrained(str(path))


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One HF tensor to write: its name, size on disk, the parameter it comes from and its layer slot."""

  name: str
  nbytes: int
  entry: _Entry
  var: nnx.Variable
  slot: int | None  # layer index into a stacked (scan_layers) parameter, else None


def _shard_plan(state: nnx.State, cfg: ModelConfig, *, itemsize: int, max_shard_bytes: int) -> list[list[_Tensor]]:
  """Every HF tensor in HF order (embedding, layers in order, final norm, head), split greedily into
  shards of at most ``max_shard_bytes`` (a tensor larger than that gets a shard of its own)."""
  plan = []
  for entry, var in _entries(state, cfg):
    layer_shape = var.shape[1:] if entry.stacked else var.shape
    nbytes = math.prod(entry.layout.hf_shape(layer_shape)) * itemsize
    for slot, name in enumerate(entry.hf_names()):
      plan.append(_Tensor(name, nbytes, entry, var, slot if entry.stacked else None))
  plan.sort(key=lambda t: _hf_order(t.name))
  shards: list[list[_Tensor]] = [[]]
  size = 0
  for tensor in plan:
    if shards[-1] and size + tensor.nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(tensor)
    size += tensor.nbytes
  return shards


def _shard_names(count: int) -> list[str]:
  if count == 1:
    return [SAFETENSORS_FILE]
  return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _write_shards(shards: list[list[_Tensor]], path: Path, np_dtype, *, writer: bool) -> dict[str, str]:
  """Gathers each shard's tensors to the host in the HF layout (every process: the gathers are collective),
  writes them when ``writer``, and returns the weight map (tensor name -> file name)."""
  weight_map = {}
  for fname, shard in zip(_shard_names(len(shards)), shards):
    tensors = {}
    for t in shard:
      tensors[t.name] = t.entry.layout.to_hf(_host_array(t.var.get_value(), t.slot).astype(np_dtype))
      weight_map[t.name] = fname
    if writer:
      save_file(tensors, str(path / fname), metadata={"format": "pt"})
  return weight_map


def _write_index(path: Path, shards: list[list[_Tensor]], weight_map: dict[str, str]) -> None:
  """``model.safetensors.index.json`` for several shards; a stale one is removed for a single file."""
  if len(shards) > 1:
    total = sum(t.nbytes for shard in shards for t in shard)
    with open(path / SAFETENSORS_INDEX, "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
  else:
    (path / SAFETENSORS_INDEX).unlink(missing_ok=True)


def _hf_config(cfg: ModelConfig, dtype: str, tokenizer) -> dict[str, Any]:
  """``config.json``'s contents: the model's HF config, with the tokenizer's special-token ids when given."""
  extra = {}
  if tokenizer is not None:
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
      if getattr(tokenizer, k, None) is not None:
        extra[k] = getattr(tokenizer, k)
  return cfg.to_hf_config(torch_dtype=dtype, **extra)


def _hf_order(name: str):
  parts = name.split(".")
  if parts[:2] == ["model", "embed_tokens"]:
    return (0, 0, name)
  if parts[:2] == ["model", "layers"]:
    return (1, int(parts[2]), name)
  if parts[:2] == ["model", "norm"]:
    return (2, 0, name)
  if parts[0] == "visual":
    return (4, int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else -1, name)
  return (3, 0, name)


# --------------------------------------------------------------------------------------------------
# Tokenizers


def load_tokenizer(path: str | os.PathLike):
  """``transformers.AutoTokenizer.from_pretrained`` on a local directory, with a clear error if absent."""
  path = Path(path)
  if not path.is_dir():
    raise FileNotFoundError(f"tokenizer directory {path} does not exist")
  if not any((path / f).exists() for f in TOKENIZER_FILES):
    raise FileNotFoundError(f"{path}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})")
  from transformers import AutoTokenizer
  try:
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
  except Exception as e:  # transformers raises many types; name the directory
    raise ValueError(f"{path}: could not load the tokenizer: {e}") from e


def tokenizer_fingerprint(tokenizer) -> str:
  """``sha256:<hex>`` over what makes token ids mean the same: ``get_vocab()`` (every token string and its id,
  added tokens included), the special tokens and the bos/eos/pad/unk ids. Two tokenizers with equal fingerprints
  turn text into the same ids and back; ``jaxrl serve`` lists its tokenizer's in ``/v1/models``, and a
  distillation run checks its teacher server against the student's with it (docs/rl.md)."""
  import hashlib
  special = {k: getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk")}
  blob = json.dumps({"vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0])),
                     "special": sorted(getattr(tokenizer, "all_special_tokens", [])), "ids": special},
                    ensure_ascii=False, separators=(",", ":"))
  return "sha256:" + hashlib.sha256(blob.encode("utf-8")).hexdigest()


def check_tokenizer(tokenizer, cfg: ModelConfig) -> None:
  """Raises if the tokenizer can emit ids the embedding has no row for (``len(tokenizer) > vocab_size``).

  A smaller tokenizer is fine (HF checkpoints pad the embedding, e.g. 151936 rows for ~151665 tokens).
  """
  n = len(tokenizer)
  if n > cfg.vocab_size:
    raise ValueError(
        f"tokenizer has {n} tokens (len(tokenizer), added tokens included) but the model embedding has "
        f"vocab_size={cfg.vocab_size} rows: ids >= {cfg.vocab_size} would have no embedding")
