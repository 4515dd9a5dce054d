"""SFT data: Grain sources, chat-template tokenisation with loss masks, sequence packing, tasks.

Layer (docs/design.md): may import ``models`` (the tokenizer) and the layers below; not ``losses`` or anything
above.
"""

from jaxrl.data._chat import encode_chat, encode_prompt, encode_record
from jaxrl.data._images import (
    CLIP_MEAN,
    CLIP_STD,
    MAX_ASPECT_RATIO,
    ImageConfig,
    load_image,
    num_image_tokens,
    process_image,
    smart_resize,
)
from jaxrl.data._packing import (
    PACKING_METHODS,
    ROW_KEYS,
    PackedBatch,
    PackedBatchIterDataset,
    PackedRowsIterDataset,
    PackingConfig,
    PackingStats,
    assign_rows,
    fit_sample,
    pack_samples,
    stack_rows,
)
from jaxrl.data._pipeline import DataConfig, sft_batches, sft_samples
from jaxrl.data._skips import SkipReport
from jaxrl.data._sources import (
    DataError,
    JsonlSource,
    ParquetSource,
    check_fingerprint,
    open_source,
    record_messages,
)
from jaxrl.data._synthetic import (
    ArithmeticConfig,
    BuiltinTask,
    exact_match,
    extract_answer,
    generate_arithmetic,
    reasoning_gym_records,
    solve,
    write_arithmetic_splits,
    write_jsonl,
)
from jaxrl.data._task_data import TaskData
from jaxrl.data._tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_tokenizer, tiny_tokenizer_dir, tokenizer_dir

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "MAX_ASPECT_RATIO",
    "ImageConfig",
    "load_image",
    "num_image_tokens",
    "process_image",
    "smart_resize",
    "BuiltinTask",
    "CHAT_TEMPLATE",
    "PACKING_METHODS",
    "ROW_KEYS",
    "SPECIAL_TOKENS",
    "ArithmeticConfig",
    "DataConfig",
    "DataError",
    "JsonlSource",
    "PackedBatch",
    "PackedBatchIterDataset",
    "PackedRowsIterDataset",
    "PackingConfig",
    "PackingStats",
    "ParquetSource",
    "SkipReport",
    "TaskData",
    "assign_rows",
    "build_tiny_tokenizer",
    "check_fingerprint",
    "encode_chat",
    "encode_prompt",
    "encode_record",
    "exact_match",
    "extract_answer",
    "fit_sample",
    "generate_arithmetic",
    "open_source",
    "pack_samples",
    "reasoning_gym_records",
    "record_messages",
    "sft_batches",
    "sft_samples",
    "solve",
    "stack_rows",
    "tiny_tokenizer_dir",
    "tokenizer_dir",
    "write_arithmetic_splits",
    "write_jsonl",
]
