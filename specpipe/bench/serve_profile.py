"""Where a served level's time goes: closed-loop streaming users through the real Triton server, with the served
model recording every engine call of its scheduler and every answer's response path (triton/profile.py).

    python -m specpipe.bench.serve_profile ENGINES_OR_REPO [--users 16] [--per-user 4] [--json-out PATH]

Within the steady window (every user has a request in flight; bench/load.py), the scheduler thread's wall time
splits into its engine calls by kind (prefill, decode, stopped decodes, drafts, verifies) and the rest (`between
calls`: Python between calls, waiting for the GIL or a core). Besides: CPU seconds of tritonserver, the model's
stub process and this client process, the answering threads' CPU and send time per token, and the decode calls'
rate (tokens / time in decode calls) against what the users received and against the same engine alone in this
process right after the level (bench/load_alone.py: a full batch's one-token steps over the same prompts).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import numpy as np

PROFILE_FILE = "served-*.json"


def breakdown(calls: list, window: tuple[float, float]) -> dict:
    """Per kind over the calls that started in `window` (time.time() seconds): calls, rows, tokens, seconds and
    share of the window; `between calls` is the rest of the window."""
    span = window[1] - window[0]
    kinds: dict[str, dict] = {}
    for kind, rows, tokens, t0, t1 in calls:
        if window[0] <= t0 < window[1]:
            entry = kinds.setdefault(kind, {"calls": 0, "rows": 0, "tokens": 0, "s": 0.0})
            entry["calls"] += 1
            entry["rows"] += rows
            entry["tokens"] += tokens
            entry["s"] += min(t1, window[1]) - t0
    busy = sum(k["s"] for k in kinds.values())
    kinds["between calls"] = {"calls": 0, "rows": 0, "tokens": 0, "s": span - busy}
    for entry in kinds.values():
        entry["share"] = entry["s"] / span if span > 0 else None
    return {"window_s": span, "kinds": kinds}


def steady_window(level, level_start: float) -> tuple[float, float]:
    """The last user's first request sent -> the first user's last request done, on the wall clock."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for r in level.records:
        sent = level_start + r.sent_ms / 1e3
        first[r.stream] = min(first.get(r.stream, sent), sent)
        last[r.stream] = max(last.get(r.stream, sent), sent + (r.total_ms or 0.0) / 1e3)
    return max(first.values()), min(last.values())


def profile_level(target: Path, users: int, per_user: int, max_tokens: int, out_dir: Path,
                  stream_interval: Optional[int] = None) -> dict:
    import psutil

    from specpipe.bench.config import LoadConfig
    from specpipe.bench.load import _repository, _started_server, request_tensors
    from specpipe.bench.load_alone import EngineAlone
    from specpipe.bench.prompts import packaged_set
    from specpipe.machine import describe_machine
    from specpipe.triton.client import DEFAULT_MODEL
    from specpipe.triton.load import run_level, summarize_level
    from specpipe.triton.profile import PROFILE_ENV

    cfg = LoadConfig(max_tokens=max_tokens)
    prompts = [p.prompt for p in packaged_set(cfg.prompt_set).prompts]
    make = lambda i: request_tensors(prompts[i % len(prompts)], cfg)  # noqa: E731
    cpu = lambda process: sum(process.cpu_times()[:2])  # noqa: E731
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(PROFILE_FILE):
        old.unlink()
    os.environ[PROFILE_ENV] = str(out_dir)  # the server, started below, passes it on to the model's stub
    load_before = os.getloadavg()
    try:
        with ExitStack() as stack:
            repo = stack.enter_context(_repository(Path(target), DEFAULT_MODEL, stream_interval=stream_interval))
            alone = EngineAlone.of_repository(repo, DEFAULT_MODEL)  # before the server: its load is not in the level
            server = stack.enter_context(_started_server(repo, lambda line: None))
            processes = {"tritonserver": psutil.Process(server.process.pid)}
            stubs = [p for p in processes["tritonserver"].children(recursive=True) if "stub" in p.name()]
            processes.update({f"stub {i}": p for i, p in enumerate(stubs)})
            processes["clients (this process)"] = psutil.Process()
            warmup = run_level(server.url, DEFAULT_MODEL, make, 1, 2)
            stagger_s = float(np.median([r.total_ms for r in warmup.records])) / 1e3
            cpu0 = {name: cpu(p) for name, p in processes.items()}
            begun = time.time()
            level = run_level(server.url, DEFAULT_MODEL, make, users, users * per_user, server_pid=server.process.pid,
                              stagger_s=stagger_s)
            ended = time.time()
            cpu_s = {name: cpu(p) - cpu0[name] for name, p in processes.items()}
            engine_alone = alone.measure([make(i) for i in range(users)], burst=False, runs=3)
    finally:
        os.environ.pop(PROFILE_ENV, None)
    served = [json.loads(path.read_text()) for path in out_dir.glob(PROFILE_FILE)]  # written as the server stopped
    window = steady_window(level, begun)
    summary = summarize_level(level)
    tokens = sum(r.tokens for r in level.records if r.error is None)
    answers = [a for s in served for a in s["answers"] if a["start"] >= begun]  # not the warm-up's
    per_instance = [breakdown(s["calls"], window) for s in served]
    whole_level = [breakdown(s["calls"], (begun, ended)) for s in served]
    decode = per_instance[0]["kinds"].get("decode") if len(per_instance) == 1 else None
    return {
        "machine": describe_machine().summary(), "load_before": load_before, "load_after": os.getloadavg(),
        "target": str(target), "users": users, "requests": len(level.records), "max_tokens": max_tokens,
        "level": {k: v for k, v in summary.items() if not isinstance(v, (list, dict))},
        "scheduler": per_instance, "scheduler_whole_level": whole_level,  # steady window; ramp-up and tail too
        "decode_calls_tokens_per_s": decode["tokens"] / decode["s"] if decode and decode["s"] else None,
        "decode_call_ms": decode["s"] / decode["calls"] * 1e3 if decode and decode["calls"] else None,
        "decode_call_rows": decode["rows"] / decode["calls"] if decode and decode["calls"] else None,
        # the same engine in this process right after, on the users' first prompts: its full batch's rate
        "engine_alone": engine_alone,
        "cpu_s": cpu_s, "tokens": tokens,
        "cpu_ms_per_token": {name: s / tokens * 1e3 for name, s in cpu_s.items()} if tokens else {},
        "answers": {"requests": len(answers),
                    "cpu_ms_per_token": sum(a["cpu_s"] for a in answers) / max(1, sum(a["tokens"] for a in answers)) * 1e3,
                    "send_ms_per_response": sum(a["send_s"] for a in answers) / max(1, sum(a["responses"] for a in answers)) * 1e3,
                    "tokens_per_response": sum(a["tokens"] for a in answers) / max(1, sum(a["responses"] for a in answers)),
                    "cancel_check_ms": sum(a.get("cancel_check_s", 0.0) for a in answers)
                                       / max(1, sum(a.get("cancel_checks", 0) for a in answers)) * 1e3},
    }


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    from specpipe.errors import SpecpipeError

    parser = argparse.ArgumentParser(prog="python -m specpipe.bench.serve_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path, help="a Triton repository or a built deployment (engines/NAME)")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--per-user", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stream-interval", type=int, default=None,
                        help="tokens a streamed response gathers, in the repository written for engines/NAME")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    import tempfile

    try:
        with tempfile.TemporaryDirectory(prefix="specpipe-profile-") as scratch:
            result = profile_level(args.target, args.users, args.per_user, args.max_tokens, Path(scratch),
                                   stream_interval=args.stream_interval)
    except SpecpipeError as err:
        print(f"error: {err}")
        return 2
    text = json.dumps(result, indent=1)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
