"""The physical limit of decoding on this machine: bytes of weights read per token / memory bandwidth.

One decode step of a batch-1 LLM reads every weight once, so ms/token cannot drop below
weight_bytes / bandwidth. Bandwidth is measured the way decoding uses memory: a large fp32
matrix-vector product (numpy), which streams the matrix once per call.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

# 256 MiB of fp32: far beyond any cache level, so the product streams from DRAM.
_MATRIX_BYTES = 256 << 20


def measure_bandwidth(repeats: int = 7, matrix_bytes: int = _MATRIX_BYTES) -> float:
    """Bytes per second of a large fp32 matrix-vector product (median of `repeats`, after one warm-up)."""
    cols = 4096
    rows = matrix_bytes // (4 * cols)
    matrix = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    vector = np.ones(cols, dtype=np.float32)
    matrix @ vector  # warm-up: page faults and BLAS thread start-up are not bandwidth
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        matrix @ vector
        seconds.append(time.perf_counter() - t0)
    return matrix.nbytes / statistics.median(seconds)


def weight_bytes(engine_dir: Path) -> int:
    """Bytes of weights one decode step reads: every initializer of the engine's ONNX graph, except the
    tables only ever gathered from (an embedding lookup reads one row, not the table)."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(Path(engine_dir) / "model.onnx"), load_external_data=False)
    graph = model.graph
    gathered = {node.input[0] for node in graph.node if node.op_type == "Gather"}
    used_otherwise = {name for node in graph.node if node.op_type != "Gather" for name in node.input}
    total = 0
    for init in graph.initializer:
        if init.name in gathered and init.name not in used_otherwise:
            continue
        if uses_external_data(init):
            total += int({e.key: e.value for e in init.external_data}.get("length", 0))
        else:
            total += len(init.raw_data) or _typed_bytes(init)
    return total


def _typed_bytes(init) -> int:
    from onnx import helper

    count = int(np.prod(init.dims)) if init.dims else 1
    return count * np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize


def floor_ms_per_token(engine_dir: Path, bandwidth_bytes_per_s: float) -> float:
    return weight_bytes(engine_dir) / bandwidth_bytes_per_s * 1e3
