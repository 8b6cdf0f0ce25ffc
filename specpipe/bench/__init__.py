"""Benchmarks: target-only vs speculative decoding (K = 1..8, adaptive) vs transformers' assisted generation,
same engines, prompts and settings, one run; with the physical limit of the machine beside them.

    run_bench(BenchConfig(engine_dir=Path("engines/NAME")))  -> results dict (what --json prints)
"""

from specpipe.bench.harness import Measurement, SpecRow, run_rows, spec_rows, summarize
from specpipe.bench.run import run_bench

__all__ = ["Measurement", "SpecRow", "run_bench", "run_rows", "spec_rows", "summarize"]
