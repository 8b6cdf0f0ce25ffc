"""Inference engines behind one interface. `load_engine` opens a folder with the backend its engine.json
names, importing that backend only then (TensorRT needs CUDA)."""

from __future__ import annotations

from pathlib import Path

from specpipe.config import THREADS
from specpipe.engines.base import Engine, EngineBatch, EngineSequence, read_engine_meta
from specpipe.errors import EngineError

__all__ = ["Engine", "EngineBatch", "EngineSequence", "load_engine", "read_engine_meta"]


def load_engine(folder: str | Path, *, threads: int = THREADS, min_rows: int = 1, spinning: bool = True) -> Engine:
    """Open the engine in `folder`, choosing the backend its engine.json names (imported lazily).

    `min_rows`: run shorter calls padded to this many rows (engines/onnxruntime.py: a target opened with 2
    scores a position alike in a 1-token step and inside a verify call). `spinning`: ONNX Runtime's worker threads
    spin while they wait inside a call (engines/onnxruntime.py `session_options`)."""
    folder = Path(folder)
    meta = read_engine_meta(folder)
    backend = meta.get("backend", "onnxruntime")
    if backend == "onnxruntime" and meta.get("kv_layout") == "shared":
        from specpipe.engines.shared_kv import SharedKVEngine  # onnxruntime-genai's builder graph

        return SharedKVEngine(folder, threads=threads, min_rows=min_rows, spinning=spinning)
    if backend == "onnxruntime":
        from specpipe.engines.onnxruntime import OrtEngine

        return OrtEngine(folder, threads=threads, min_rows=min_rows, spinning=spinning)
    if backend == "tensorrt":
        from specpipe.engines.tensorrt import TensorRTEngine  # needs CUDA + tensorrt

        return TensorRTEngine(folder)
    raise EngineError(f"{folder}: unknown engine backend {backend!r}")
