"""Describe a checkpoint folder without loading its weights: architecture, sizes, tokenizer facts.

`inspect_checkpoint(path).model_dump()` is what the build manifest records for each model, under the names
it always had; the architecture numbers are read as a plan reads them (facts.py `config_numbers`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict

from specpipe.checkpoint.cache import weight_files
from specpipe.checkpoint.facts import CONFIG_KEYS, config_numbers
from specpipe.checkpoint.gguf_convert import read_source_record
from specpipe.checkpoint.load import (architecture_of, is_causal_lm, load_config, load_tokenizer, safetensors_header,
                                      tokenizer_hash)

_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


class CheckpointInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    architecture: str
    model_type: str
    is_causal_lm: bool
    num_parameters: Optional[int]
    num_layers: Optional[int]
    hidden_size: Optional[int]
    intermediate_size: Optional[int]
    num_heads: Optional[int]
    num_kv_heads: Optional[int]
    head_dim: Optional[int]
    vocab_size: int  # rows of the embedding / logits (config.vocab_size)
    tokenizer_vocab_size: int  # len(tokenizer): ids the tokenizer can produce, added tokens included
    dtype: Optional[str]  # of the stored weights (most elements), e.g. "float32"
    weights_format: str  # "safetensors" or "pickle"
    weights_bytes: int
    max_position_embeddings: Optional[int]
    rope_theta: Optional[float]
    tie_word_embeddings: bool
    bos_token_id: Optional[int]
    bos_token: Optional[str]
    eos_token_id: Optional[int]
    eos_token: Optional[str]
    pad_token_id: Optional[int]  # None when the tokenizer defines no pad token (never invented here)
    pad_token: Optional[str]
    eos_token_ids: list[int]  # every id that ends generation: tokenizer EOS, config and generation_config EOS
    tokenizer_class: str
    tokenizer_hash: str
    has_chat_template: bool
    converted_from: Optional[dict]  # specpipe-source.json of a GGUF conversion, else None


def inspect_checkpoint(path: Path) -> CheckpointInfo:
    path = Path(path)
    config = load_config(path)
    tokenizer = load_tokenizer(path)
    files = weight_files(path)
    safetensors = [f for f in files if f.suffix == ".safetensors"]
    if safetensors:
        num_parameters, dtype = _safetensors_summary(safetensors)
    else:
        num_parameters, dtype = _count_parameters_from_config(config), _torch_dtype_name(config)
    numbers = config_numbers({key: getattr(config, key, None) for key in CONFIG_KEYS})
    return CheckpointInfo(
        path=str(path),
        architecture=architecture_of(config),
        model_type=config.model_type,
        is_causal_lm=is_causal_lm(config),
        num_parameters=num_parameters,
        num_layers=numbers["layers"],
        hidden_size=numbers["hidden"],
        intermediate_size=numbers["intermediate"],
        num_heads=numbers["heads"],
        num_kv_heads=numbers["kv_heads"],
        head_dim=numbers["head_dim"],
        vocab_size=config.vocab_size,
        tokenizer_vocab_size=len(tokenizer),
        dtype=dtype,
        weights_format="safetensors" if safetensors else "pickle",
        weights_bytes=sum(f.stat().st_size for f in (safetensors or files)),
        max_position_embeddings=numbers["context_length"],
        rope_theta=getattr(config, "rope_theta", None),
        tie_word_embeddings=numbers["tie_word_embeddings"],
        bos_token_id=tokenizer.bos_token_id,
        bos_token=tokenizer.bos_token,
        eos_token_id=tokenizer.eos_token_id,
        eos_token=tokenizer.eos_token,
        pad_token_id=tokenizer.pad_token_id,
        pad_token=tokenizer.pad_token,
        eos_token_ids=_eos_token_ids(path, config, tokenizer),
        tokenizer_class=type(tokenizer).__name__,
        tokenizer_hash=tokenizer_hash(tokenizer),
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        converted_from=read_source_record(path),
    )


def _safetensors_summary(files: list[Path]) -> tuple[int, Optional[str]]:
    """(parameter count, dominant dtype) from the safetensors headers alone: no weights are read."""
    elements: Counter[str] = Counter()
    for file in files:
        header = safetensors_header(file)
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for dim in tensor["shape"]:
                    count *= dim
                elements[tensor["dtype"]] += count
    if not elements:
        return 0, None
    dominant = elements.most_common(1)[0][0]
    return sum(elements.values()), _SAFETENSORS_DTYPES.get(dominant, dominant.lower())


def _count_parameters_from_config(config) -> Optional[int]:
    """Parameter count of a pickle-only checkpoint: build the model on the meta device (no memory, no unpickling)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    if not is_causal_lm(config):
        return None
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    return model.num_parameters()


def _torch_dtype_name(config) -> Optional[str]:
    dtype = getattr(config, "torch_dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _eos_token_ids(path: Path, config, tokenizer) -> list[int]:
    candidates: list = [tokenizer.eos_token_id, config.eos_token_id]
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        candidates.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    ids: list[int] = []
    for value in candidates:
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return ids
