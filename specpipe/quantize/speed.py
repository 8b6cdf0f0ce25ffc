"""Decode speed of an engine: ms per token with a fixed KV cache, next to the memory-bandwidth floor.

One measurement = one new token on top of a `context_len`-token cache (the cache is rolled back after
each run so every run sees the same length). Warm-up runs are excluded; the median is reported.
Usable from `specpipe bench` (a quant axis) and from the command line:

    python -m specpipe.quantize.speed ENGINE_DIR [ENGINE_DIR ...] [--threads 2] [--runs 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from specpipe.quantize.graph import folder_bytes


@dataclasses.dataclass(frozen=True)
class SpeedReport:
    engine: str
    quant: str
    threads: int
    context_len: int
    runs: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    weight_bytes: int  # bytes of the engine's model files: roughly what one decode step reads
    bandwidth_floor_ms: float | None  # weight_bytes / bandwidth: no decode step can be faster

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def measure_speed(
    engine_dir: Path,
    *,
    threads: int = 2,
    context_len: int = 64,
    runs: int = 20,
    warmup: int = 3,
    bandwidth_gb_s: float | None = None,
) -> SpeedReport:
    """Median ms for one decode step of the engine in `engine_dir` (see the module docstring)."""
    from specpipe.engines.base import load_engine, read_engine_meta

    engine = load_engine(engine_dir, threads=threads)
    context = [(7 * i + 11) % min(engine.vocab_size, 1000) for i in range(context_len)]  # any fixed tokens
    sequence = engine.new_sequence()
    sequence.append(context)
    timings = []
    for run in range(warmup + runs):
        started = time.perf_counter()
        sequence.append([context[run % context_len]])
        elapsed = time.perf_counter() - started
        sequence.truncate(context_len)
        if run >= warmup:
            timings.append(elapsed * 1e3)
    timings.sort()
    weight_bytes = folder_bytes(engine_dir)
    return SpeedReport(
        engine=str(engine_dir),
        quant=str(read_engine_meta(engine_dir).get("quant", "none")),
        threads=threads,
        context_len=context_len,
        runs=runs,
        median_ms=statistics.median(timings),
        p10_ms=timings[len(timings) // 10],
        p90_ms=timings[(len(timings) * 9) // 10],
        weight_bytes=weight_bytes,
        bandwidth_floor_ms=weight_bytes / (bandwidth_gb_s * 1e9) * 1e3 if bandwidth_gb_s else None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engines", nargs="+", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--bandwidth-gb-s", type=float, default=None, help="measured memory bandwidth, for the floor")
    args = parser.parse_args()
    for engine_dir in args.engines:
        report = measure_speed(
            engine_dir, threads=args.threads, context_len=args.context_len, runs=args.runs, bandwidth_gb_s=args.bandwidth_gb_s
        )
        print(json.dumps(report.as_dict()), flush=True)


if __name__ == "__main__":
    main()
