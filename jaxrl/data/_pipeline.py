"""The SFT input pipeline on Grain: source → shuffle → shard per process → tokenise → pack → batch.

``sft_samples`` gives a Grain ``IterDataset`` of tokenised samples; ``sft_batches`` adds packing
and yields :class:`jaxrl.data.PackedBatch` es of ``global_rows // process_count`` rows on each JAX
process. Every iterator in the chain has ``get_state()`` / ``set_state()``; restoring a state gives
the same next elements.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import grain
import jax

from jaxrl.data._chat import encode_record
from jaxrl.data._packing import PackedBatchIterDataset, PackingConfig
from jaxrl.data._sources import open_source


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """Where SFT records come from and how they are read."""

  paths: tuple[str, ...] = ()
  "JSONL (``.jsonl``) or Parquet (``.parquet``) files of ``messages`` or ``prompt/completion`` records."
  format: Literal["auto", "jsonl", "parquet"] = "auto"
  "File format; ``auto`` picks by suffix."
  seed: int = 0
  "Shuffle seed (each epoch is shuffled differently, deterministically)."
  shuffle: bool = True
  "Shuffle records globally before sharding."
  num_epochs: int | None = 1
  "Passes over the data; None repeats forever."
  max_bad_records: int = 0
  "Bad records (malformed JSON, missing fields, empty completion, non-UTF-8) skipped before erroring."
  end_of_turn: str | None = None
  "String closing an assistant turn (trained); default the tokenizer's ``eos_token``."
  num_threads: int = 2
  "Grain reader threads for reading and tokenising."

  def __post_init__(self):
    if self.format not in ("auto", "jsonl", "parquet"):
      raise ValueError(f"format must be 'auto', 'jsonl' or 'parquet', got {self.format!r}")
    if self.num_epochs is not None and self.num_epochs < 1:
      raise ValueError(f"num_epochs must be >= 1 or None, got {self.num_epochs!r}")
    if self.max_bad_records < 0:
      raise ValueError(f"max_bad_records must be >= 0, got {self.max_bad_records!r}")
    if self.num_threads < 0:
      raise ValueError(f"num_threads must be >= 0, got {self.num_threads!r}")


class _Encode:
  """Picklable ``record -> encode_record(tokenizer, record)`` (for Grain worker processes)."""

  def __init__(self, tokenizer, end_of_turn: str | None):
    self.tokenizer = tokenizer
    self.end_of_turn = end_of_turn

  def __call__(self, record):
    return encode_record(self.tokenizer, record, end_of_turn=self.end_of_turn)


def sft_samples(config: DataConfig, tokenizer, *, process_index: int | None = None,
                process_count: int | None = None) -> grain.IterDataset:
  """Tokenised samples of this process's shard.

  Args:
    config: data settings (``config.paths`` must be non-empty).
    tokenizer: a ``transformers`` tokenizer with a chat template.
    process_index: shard to read; default ``jax.process_index()``.
    process_count: number of shards; default ``jax.process_count()``.

  Returns:
    A Grain ``IterDataset`` of dicts with ``tokens``, ``loss_mask``, ``turn_id``, ``sample_id``
    (each [L]); see :func:`jaxrl.data.encode_record`. Its ``source`` attribute is the record source
    (``bad_reasons``, ``fingerprint()``).
  """
  if not config.paths:
    raise ValueError("DataConfig.paths is empty; give at least one data file")
  pi = jax.process_index() if process_index is None else process_index
  pc = jax.process_count() if process_count is None else process_count
  if not 0 <= pi < pc:
    raise ValueError(f"process_index {pi} is outside [0, {pc})")
  source = open_source(list(config.paths), format=config.format,
                       max_bad_records=config.max_bad_records)
  if len(source) < pc:
    raise ValueError(f"{len(source)} records cannot be sharded over {pc} processes")
  ds = grain.MapDataset.source(source)
  if config.shuffle:
    ds = ds.shuffle(seed=config.seed)
  ds = ds[pi::pc]
  if config.num_epochs != 1:
    ds = ds.repeat(config.num_epochs)
  ds = ds.map(_Encode(tokenizer, config.end_of_turn))
  out = ds.to_iter_dataset(grain.ReadOptions(num_threads=config.num_threads))
  out.source = source  # its bad records and fingerprint, for the skip report and the checkpoint
  return out


def sft_batches(data: DataConfig, packing: PackingConfig, tokenizer, *,
                process_index: int | None = None,
                process_count: int | None = None) -> PackedBatchIterDataset:
  """Packed batches for this process: ``global_rows // process_count`` rows of ``seq_len``.

  ``sample_ids``/``turn_ids`` are offset by ``process_index * rows * seq_len`` so that they stay
  unique in the global batch assembled from all processes (``jaxrl.sharding.global_batch``).
  """
  pi = jax.process_index() if process_index is None else process_index
  pc = jax.process_count() if process_count is None else process_count
  if packing.global_rows % pc:
    raise ValueError(f"global_rows={packing.global_rows} does not split over {pc} processes")
  rows = packing.global_rows // pc
  samples = sft_samples(data, tokenizer, process_index=pi, process_count=pc)
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
  out = PackedBatchIterDataset(samples, config=packing, pad_id=pad_id, num_rows=rows,
                               id_offset=pi * rows * packing.seq_len)
  out.source = samples.source
  return out
