"""Token batches for calibration and for the accuracy check, and the reader that feeds them to ONNX Runtime.

Calibration uses prompts (the packaged set, or the user's JSONL of {"prompt": ...} lines). The accuracy
check uses held-out text plus evaluation prompts that are disjoint from the calibration prompts, so a
quantizer cannot look good by having seen the very activations it is judged on.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Sequence

import numpy as np

from specpipe.contract.quant import QuantConfig
from specpipe.errors import UsageError
from specpipe.quantize.graph import kv_input_shapes

DATA = resources.files("specpipe.quantize") / "data"
PACKAGED_CALIB_PROMPTS = "calib_prompts.jsonl"
PACKAGED_EVAL_PROMPTS = "eval_prompts.jsonl"
PACKAGED_HELDOUT_TEXT = "heldout_text.jsonl"


def read_jsonl_field(path: Path, field: str) -> list[str]:
    """The `field` strings of a JSONL file; a missing file, a bad line or no entries at all is a UsageError."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"calibration prompts file {path} does not exist")
    values = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)[field]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UsageError(f"{path}:{line_no} is not a JSON object with a {field!r} string") from None
        if isinstance(value, str) and value.strip():
            values.append(value)
    if not values:
        raise UsageError(f"{path} holds no {field!r} entries: no calibration data")
    return values


def _packaged(name: str, field: str) -> list[str]:
    with resources.as_file(DATA / name) as path:
        return read_jsonl_field(path, field)


def calibration_prompts(cfg: QuantConfig) -> list[str]:
    """The first `cfg.calib_size` calibration prompts (the user's file, or the packaged set)."""
    prompts = read_jsonl_field(cfg.calib_prompts, "prompt") if cfg.calib_prompts else _packaged(PACKAGED_CALIB_PROMPTS, "prompt")
    return prompts[: cfg.calib_size]


def encode_prompts(tokenizer, prompts: Sequence[str], *, max_tokens: int, chat: bool = True) -> list[list[int]]:
    """Token ids of each prompt, rendered with the chat template when the tokenizer has one (as served)."""
    batches = []
    for prompt in prompts:
        if chat and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        else:
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        batches.append([int(t) for t in ids[:max_tokens]])
    return batches


def calibration_batches(tokenizer, cfg: QuantConfig) -> list[list[int]]:
    return encode_prompts(tokenizer, calibration_prompts(cfg), max_tokens=cfg.calib_window)


def evaluation_batches(tokenizer, cfg: QuantConfig, *, max_tokens: int = 256) -> list[list[int]]:
    """Held-out text and evaluation prompts, minus any prompt that is also a calibration prompt."""
    calibration = set(calibration_prompts(cfg)) if cfg.needs_calibration else set()
    prompts = [p for p in _packaged(PACKAGED_EVAL_PROMPTS, "prompt") if p not in calibration]
    texts = _packaged(PACKAGED_HELDOUT_TEXT, "text")
    text_batches = [[int(t) for t in tokenizer(text)["input_ids"][:max_tokens]] for text in texts]
    return text_batches + encode_prompts(tokenizer, prompts, max_tokens=max_tokens)


def prefill_feed(token_ids: Sequence[int], kv_shapes: dict[str, tuple[int, int]]) -> dict[str, np.ndarray]:
    """Inputs for one sequence run from an empty KV cache (past length 0), as the engine's prefill does."""
    length = len(token_ids)
    feed = {
        "input_ids": np.asarray([token_ids], dtype=np.int64),  # [1, T]
        "attention_mask": np.ones((1, length), dtype=np.int64),  # [1, T]
        "position_ids": np.arange(length, dtype=np.int64)[None, :],  # [1, T]
    }
    for name, (kv_heads, head_dim) in kv_shapes.items():
        feed[name] = np.zeros((1, kv_heads, 0, head_dim), dtype=np.float32)  # [1, kv_heads, 0, head_dim]
    return feed


def pack_windows(token_batches: Sequence[Sequence[int]], window: int) -> list[list[int]]:
    """Concatenate the sequences and cut the stream into windows of equal length (the remainder is dropped).

    ORT's histogram calibrators (Distribution, Entropy, Percentile) stack each tensor's values across
    runs and fail on ragged shapes, so every calibration run gets the same number of tokens.
    Example: lengths [5, 3, 4], window 4 -> stream of 12 -> windows [0:4], [4:8], [8:12].
    """
    stream = [int(t) for ids in token_batches for t in ids]
    window = min(window, len(stream))
    return [stream[start : start + window] for start in range(0, len(stream) - window + 1, window)] if window else []


class KvCalibrationReader:
    """onnxruntime.quantization CalibrationDataReader over token windows, with zero-length past inputs.

    Subclassing CalibrationDataReader is not needed (it checks for `get_next`), which keeps
    onnxruntime.quantization out of the import path of this module.
    """

    def __init__(self, model, token_batches: Sequence[Sequence[int]], *, window: int):
        graph_inputs = {graph_input.name for graph_input in model.graph.input}
        self._kv_shapes = kv_input_shapes(model)
        self._drop = {"position_ids"} - graph_inputs  # some exports have no position_ids input
        self._batches = pack_windows(token_batches, window)
        self._next = 0

    def get_next(self) -> dict | None:
        if self._next >= len(self._batches):
            return None
        feed = prefill_feed(self._batches[self._next], self._kv_shapes)
        self._next += 1
        return {name: value for name, value in feed.items() if name not in self._drop}

    def rewind(self) -> None:
        self._next = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        feed = self.get_next()
        if feed is None:
            raise StopIteration
        return feed

    def __len__(self) -> int:
        return len(self._batches)
