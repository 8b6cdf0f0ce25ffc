"""The physical limit of decoding on this machine: bytes of weights read per token / memory bandwidth.

One decode step of a batch-1 LLM reads every weight once, so ms/token cannot drop below
weight_bytes / bandwidth. Bandwidth is measured the way decoding uses memory: a large fp32
matrix-vector product (numpy), which streams the matrix once per call.

The bandwidth a machine gives is not one number. On the 2-core Zen 3 VM of session 20 the same measurement read
32-37 GB/s most of the time and ~50 GB/s for seconds at a time (6 calls in one process: 33.5 34.1 50.2 50.4
35.1 36.5), so a floor taken once, minutes away from the decode it judges, moved "x the floor" by 1.5x between
runs. `paired_floor` therefore takes turns: a bandwidth reading, then the engine's decode step, several rounds,
and judges each step against the bandwidth of its own round.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

# 256 MiB of fp32: far beyond any cache level, so the product streams from DRAM.
_MATRIX_BYTES = 256 << 20


def bandwidth_matrix(matrix_bytes: int = _MATRIX_BYTES) -> np.ndarray:
    """The fp32 matrix `measure_bandwidth` streams (making it takes ~1 s: make it once for several readings)."""
    cols = 4096
    return np.random.default_rng(0).standard_normal((matrix_bytes // (4 * cols), cols), dtype=np.float32)


def measure_bandwidth(repeats: int = 7, matrix_bytes: int = _MATRIX_BYTES, matrix: Optional[np.ndarray] = None) -> float:
    """Bytes per second of a large fp32 matrix-vector product (median of `repeats`, after one warm-up)."""
    if matrix is None:
        matrix = bandwidth_matrix(matrix_bytes)
    vector = np.ones(matrix.shape[1], dtype=np.float32)
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


def floor_ms(weight_bytes_per_token: int, bandwidth_bytes_per_s: float) -> float:
    """The fastest a decode step reading `weight_bytes_per_token` can be at this bandwidth."""
    return weight_bytes_per_token / bandwidth_bytes_per_s * 1e3


def paired_floor(step_ms: Callable[[], float], weight_bytes_per_token: int, rounds: int = 8,
                 bandwidth: Optional[Callable[[], float]] = None) -> dict:
    """`rounds` turns of (a bandwidth reading, one timing of `step_ms`: ms of one decode step). Each step is judged
    against its own round's floor (weight bytes / that round's bandwidth), so the machine's drift between readings
    moves both sides of a ratio alike. Returns the rounds, the bandwidth's median / min / max, the floor at the
    median bandwidth, and the step's ratio to its round's floor: median, min, max."""
    if bandwidth is None:
        matrix = bandwidth_matrix()
        bandwidth = lambda: measure_bandwidth(repeats=5, matrix=matrix)  # noqa: E731
    turns = []
    for _ in range(rounds):
        bytes_per_s = bandwidth()
        ms = step_ms()
        floor = floor_ms(weight_bytes_per_token, bytes_per_s)
        turns.append({"bandwidth_gb_s": bytes_per_s / 1e9, "floor_ms": floor, "step_ms": ms, "step_vs_floor": ms / floor})
    gbs = [t["bandwidth_gb_s"] for t in turns]
    ratios = [t["step_vs_floor"] for t in turns]
    median_gbs = statistics.median(gbs)
    return {
        "rounds": turns,
        "bandwidth_gb_s": median_gbs,
        "bandwidth_gb_s_min": min(gbs),
        "bandwidth_gb_s_max": max(gbs),
        "floor_ms_per_token": floor_ms(weight_bytes_per_token, median_gbs * 1e9),
        "step_vs_floor": statistics.median(ratios),
        "step_vs_floor_min": min(ratios),
        "step_vs_floor_max": max(ratios),
    }
