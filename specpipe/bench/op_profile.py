"""Where a target engine's calls spend their time, by ONNX operator: ONNX Runtime's own profiler over calls of chosen
shapes on a shared-KV engine (engines/shared_kv.py).

    python -m specpipe.bench.op_profile ENGINE_DIR [--rows 1,16] [--context 64,1024] [--new 1,2] [--json-out PATH]

A shape is (rows, context, new tokens): `rows` sequences of `context` cached tokens each (random ids, prefilled
untimed), then `--calls` calls that append `new` tokens to every row and roll back (a batched decode step when new
is 1; a lone row's multi-token call, a speculative verify's shape, when rows is 1; ONNX Runtime 1.32 refuses several
rows with several new tokens each, engines/shared_kv.py). For each shape: the median wall time of a call in a session
without the profiler (the profiler's own bookkeeping slows small nodes), and, from a second session with it, each
operator type's kernel time per call and its share of all kernels' time.

Why this exists: a decode step's cost is not all weights. On SmolLM2-135M (int8-wo, 2 threads, Intel Cascade Lake)
GroupQueryAttention took 35% of a 16-row step at 150 tokens of context and grew linearly with it (docs/benchmarks.md,
session 27), which no bandwidth floor over the weights sees.

ONNX Runtime's profile (SessionOptions.enable_profiling; the Chrome trace format it documents) holds one "Session"
event `model_run` per run and one "Node" event `<node>_kernel_time` per node executed, with `args.op_name`; a node's
event lies inside its run's [ts, ts + dur].
"""

from __future__ import annotations

import bisect
import json
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

RUN_EVENT = "model_run"
KERNEL_SUFFIX = "_kernel_time"


@dataclass(frozen=True)
class Shape:
    rows: int
    context: int
    new: int

    def label(self) -> str:
        return f"{self.rows} row{'s' if self.rows > 1 else ''} x {self.new} new at {self.context} cached"


@dataclass
class ShapeProfile:
    shape: Shape
    calls: int
    wall_ms: float  # median of one call, session without the profiler
    kernel_ms: float  # all kernels of one call, profiled (mean over the calls)
    ops: dict[str, float] = field(default_factory=dict)  # op type -> kernel ms per call, largest first

    def as_dict(self) -> dict:
        out = asdict(self)
        out["shares"] = {op: round(ms / self.kernel_ms, 4) for op, ms in self.ops.items()} if self.kernel_ms else {}
        return out


def op_time_per_run(events: list[dict], last_runs: int) -> tuple[dict[str, float], int]:
    """(op type -> kernel microseconds summed over the last `last_runs` runs of a profile, runs counted). A node
    event belongs to the run whose [ts, ts + dur] holds its start; node events of earlier runs (prefill, warm-up)
    and any outside a run are not counted."""
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == RUN_EVENT), key=lambda e: e["ts"])
    runs = runs[-last_runs:] if last_runs > 0 else []
    starts = [r["ts"] for r in runs]
    totals: Counter = Counter()
    for e in events:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith(KERNEL_SUFFIX):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] <= runs[i]["ts"] + runs[i]["dur"]:
            totals[e["args"]["op_name"]] += e["dur"]
    return dict(totals), len(runs)


def _timed_calls(engine, shape: Shape, calls: int, seed: int) -> list[float]:
    """Wall seconds of `calls` calls of `shape` on `engine` (its session as it is: profiled or not)."""
    rng = np.random.default_rng(seed)
    batch = engine.new_batch(shape.rows)
    rows = [batch.new_sequence() for _ in range(shape.rows)]
    if shape.rows == 1:
        rows[0].append(rng.integers(1, engine.vocab_size, shape.context).tolist())
    else:
        batch.prefill(rows, [rng.integers(1, engine.vocab_size, shape.context).tolist() for _ in rows])
    walls = []
    for _ in range(calls):
        tokens = rng.integers(1, engine.vocab_size, (shape.rows, shape.new)).tolist()
        started = time.perf_counter()
        if shape.rows == 1:
            rows[0].append(tokens[0])
        else:
            batch.decode(rows, [t[0] for t in tokens])
        walls.append(time.perf_counter() - started)
        for row in rows:
            row.truncate(shape.context)
    return walls


def profile_shapes(folder: Path, shapes: Sequence[Shape], *, threads: int = 2, calls: int = 10,
                   scratch: Optional[Path] = None) -> list[ShapeProfile]:
    """Each shape's unprofiled wall time and profiled per-operator kernel time (module docstring)."""
    import tempfile

    import onnxruntime as ort

    from specpipe.engines.onnxruntime import session_options
    from specpipe.engines.shared_kv import MODEL_FILE, SharedKVEngine

    for shape in shapes:
        if shape.rows < 1 or shape.context < 1 or shape.new < 1 or calls < 1:
            raise ValueError(f"{shape.label()}: rows, context, new tokens and calls must be >= 1")
        if shape.rows > 1 and shape.new > 1:
            raise ValueError(f"{shape.label()}: several rows take one new token each (module docstring)")
    plain = SharedKVEngine(folder, threads=threads)
    profiled = SharedKVEngine(folder, threads=threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="specpipe-opprof-", dir=scratch) as tmp:
        for index, shape in enumerate(shapes):
            _timed_calls(plain, shape, 2, seed=index)  # warm-up: buffers, prepacked weights
            walls = _timed_calls(plain, shape, calls, seed=index)
            options = session_options(threads)
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(tmp) / f"shape{index}")
            profiled.session = ort.InferenceSession(str(profiled.folder / MODEL_FILE), options,
                                                    providers=["CPUExecutionProvider"])
            _timed_calls(profiled, shape, calls, seed=index)
            events = json.loads(Path(profiled.session.end_profiling()).read_text())
            totals, runs = op_time_per_run(events, calls)
            ops = {op: us / runs / 1000 for op, us in sorted(totals.items(), key=lambda kv: -kv[1])}
            results.append(ShapeProfile(shape, runs, statistics.median(walls) * 1000, sum(ops.values()), ops))
    return results


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise ValueError("an empty list")
    return values


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    from specpipe.errors import SpecpipeError
    from specpipe.machine import describe_machine

    parser = argparse.ArgumentParser(prog="python -m specpipe.bench.op_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", type=Path, help="a shared-KV target engine folder (engines/NAME/target)")
    parser.add_argument("--rows", default="1,16", help="rows per call, a list [1,16]")
    parser.add_argument("--context", default="64,1024", help="cached tokens per row, a list [64,1024]")
    parser.add_argument("--new", default="1", help="new tokens per call, a list; > 1 only with 1 row [1]")
    parser.add_argument("--calls", type=int, default=10, help="timed calls per shape [10]")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=6, help="operator types printed per shape [6]")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        shapes = [Shape(r, c, n) for r in _ints(args.rows) for c in _ints(args.context) for n in _ints(args.new)
                  if r == 1 or n == 1]
        results = profile_shapes(args.engine, shapes, threads=args.threads, calls=args.calls)
    except (SpecpipeError, ValueError) as err:
        print(f"error: {err}")
        return 2
    report = {"engine": str(args.engine), "machine": describe_machine(args.threads).as_dict(),
              "shapes": [r.as_dict() for r in results]}
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(describe_machine(args.threads).summary())
    for r in results:
        print(f"{r.shape.label()}: {r.wall_ms:.2f} ms a call ({r.kernel_ms:.2f} ms in kernels, profiled)")
        for op, ms in list(r.ops.items())[: args.top]:
            print(f"  {op:36s} {ms:8.2f} ms  {100 * ms / r.kernel_ms:5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
