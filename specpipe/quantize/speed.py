"""Decode speed of engines: ms per token with a fixed KV cache, next to the memory-bandwidth floor.

One run = one new token on top of a `context_len`-token cache (the cache is rolled back after each run,
so every run sees the same length). Warm-up runs are excluded and the median is reported. Engines are
measured round-robin in `rounds` passes, so load from other processes falls on all of them alike and
their ratios stay comparable. For `specpipe bench` (the quant axis) and from the command line:

    python -m specpipe.quantize.speed ENGINE_DIR [ENGINE_DIR ...] [--threads 2] [--runs 24]
    python -m specpipe.quantize.speed --quantize-from FP32_ENGINE --tokenizer TOKENIZER_DIR --out DIR
        (quantizes FP32_ENGINE in every mode into DIR, then prints speed and accuracy for each)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Sequence

from specpipe.config import THREADS
from specpipe.quantize.graph import folder_bytes

MODES = ("none", "int8-wo", "int4-wo", "int8", "fp8")


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
    weight_bytes: int  # bytes of the engine's model files: about what one decode step must read
    bandwidth_floor_ms: float | None  # weight_bytes / memory bandwidth: no decode step can be faster

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def measure_speeds(
    engine_dirs: Sequence[Path],
    *,
    threads: int = THREADS,
    context_len: int = 64,
    runs: int = 24,
    rounds: int = 3,
    warmup: int = 3,
    bandwidth_gb_s: float | None = None,
) -> list[SpeedReport]:
    """Median ms of one decode step for each engine (see the module docstring). `runs` in total per engine."""
    from specpipe.engines import load_engine, read_engine_meta

    engines = [load_engine(folder, threads=threads) for folder in engine_dirs]
    context = [(7 * i + 11) % min(e.vocab_size for e in engines) for i in range(context_len)]  # any fixed tokens
    sequences = [engine.new_sequence() for engine in engines]
    for sequence in sequences:
        sequence.append(context)
    timings: list[list[float]] = [[] for _ in engines]
    per_round = max(1, runs // rounds)
    for round_index in range(rounds):
        for sequence, times in zip(sequences, timings):
            for run in range((warmup if round_index == 0 else 0) + per_round):
                started = time.perf_counter()
                sequence.append([context[run % context_len]])
                elapsed_ms = (time.perf_counter() - started) * 1e3
                sequence.truncate(context_len)
                if round_index > 0 or run >= warmup:
                    times.append(elapsed_ms)
    reports = []
    for folder, times in zip(engine_dirs, timings):
        times.sort()
        weight_bytes = folder_bytes(folder)
        reports.append(
            SpeedReport(
                engine=str(folder),
                quant=str(read_engine_meta(folder).get("quant", "none")),
                threads=threads,
                context_len=context_len,
                runs=len(times),
                median_ms=statistics.median(times),
                p10_ms=times[len(times) // 10],
                p90_ms=times[(len(times) * 9) // 10],
                weight_bytes=weight_bytes,
                bandwidth_floor_ms=weight_bytes / (bandwidth_gb_s * 1e9) * 1e3 if bandwidth_gb_s else None,
            )
        )
    return reports


def measure_speed(engine_dir: Path, **options) -> SpeedReport:
    return measure_speeds([engine_dir], **options)[0]


def quantize_all_modes(fp32_engine: Path, tokenizer, out_dir: Path, modes: Sequence[str] = MODES) -> dict[str, dict]:
    """Quantize `fp32_engine` in each mode into out_dir/<mode> and measure accuracy. {mode: row}."""
    from specpipe.contract.quant import QuantConfig
    from specpipe.quantize.accuracy import measure_accuracy
    from specpipe.quantize.calibration import calibration_batches, evaluation_batches
    from specpipe.quantize.pipeline import quantize_onnx

    rows = {}
    for mode in modes:
        cfg = QuantConfig(mode=mode)
        if mode == "none":
            rows[mode] = {"engine": str(fp32_engine)}
            continue
        calib = calibration_batches(tokenizer, cfg) if cfg.needs_calibration else None
        result = quantize_onnx(fp32_engine, Path(out_dir) / mode, cfg, calib)
        report = measure_accuracy(fp32_engine, Path(out_dir) / mode, evaluation_batches(tokenizer, cfg))
        rows[mode] = {"engine": str(Path(out_dir) / mode), "quantize": result.as_dict(), "accuracy": report.as_dict()}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engines", nargs="*", type=Path)
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--context-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=24)
    parser.add_argument("--bandwidth-gb-s", type=float, default=None, help="measured memory bandwidth, for the floor")
    parser.add_argument("--quantize-from", type=Path, default=None, help="unquantized engine to quantize in every mode")
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder (with --quantize-from)")
    parser.add_argument("--out", type=Path, default=None, help="where the quantized engines go (with --quantize-from)")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    engines, rows = list(args.engines), {}
    if args.quantize_from:
        from transformers import AutoTokenizer

        if not (args.tokenizer and args.out):
            parser.error("--quantize-from needs --tokenizer and --out")
        rows = quantize_all_modes(args.quantize_from, AutoTokenizer.from_pretrained(str(args.tokenizer)), args.out,
                                  args.modes.split(","))
        engines += [Path(row["engine"]) for row in rows.values()]
    if not engines:
        parser.error("give engine folders, or --quantize-from")
    speeds = measure_speeds(engines, threads=args.threads, context_len=args.context_len, runs=args.runs,
                            bandwidth_gb_s=args.bandwidth_gb_s)
    by_engine = {row["engine"]: row for row in rows.values()}
    for speed in speeds:
        print(json.dumps({**speed.as_dict(), **{k: v for k, v in by_engine.get(speed.engine, {}).items() if k != "engine"}}),
              flush=True)


if __name__ == "__main__":
    main()
