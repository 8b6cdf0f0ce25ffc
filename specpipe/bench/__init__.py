"""Benchmarks: target-only vs speculative decoding (K = 1..8, adaptive) vs transformers' assisted generation,
same engines, prompts and settings, one run; with the physical limit of the machine beside them.

    run_bench(BenchConfig(engine_dir=Path("engines/NAME")))  -> results dict (what --json prints)
"""

import importlib
from typing import Any

# Importing the package (for its config, say) loads no benchmark: the names below load their module when used.
_LAZY = {"Measurement": "harness", "SpecRow": "harness", "run_rows": "harness", "spec_rows": "harness",
         "summarize": "harness", "run_bench": "run"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"specpipe.bench.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Measurement", "SpecRow", "run_bench", "run_rows", "spec_rows", "summarize"]
