"""Precision and device for distillation, chosen by measuring on the machine at hand.

bf16 is twice as fast as fp32 where the CPU has AVX512-BF16 or AMX, and ~5-30x slower where torch
emulates it (AVX2-only CPUs: FINDINGS, "A second CPU"). No flag list predicts that reliably (a
hypervisor may hide flags, a torch build may lack a kernel), so `auto` times each candidate on the
phase's own model and shapes for about a second and keeps the faster. The timings go into the
distill record, so a reader sees why a run used what it used.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

PROBE_SECONDS = 1.0  # per candidate, after one untimed warm-up call
PROBE_MIN_ROUNDS, PROBE_MAX_ROUNDS = 3, 9
# A warm-up this many times the fastest candidate's (and over PROBE_SECONDS) is an emulated precision (5-30x
# slower): it is measured by that one call instead of being run again. A warm-up merely slower (a first bf16
# call creates its oneDNN kernels; a loaded machine) is not a measurement: on a loaded Zen 4 it measured bf16
# below fp32 (2 vs 3 tokens/s) where bf16 then ran the teacher at 142 answer tokens/s.
EMULATED_FACTOR = 4.0


@dataclass(frozen=True)
class PrecisionChoice:
    """What one phase runs in, and the measured throughput (tokens/s) of every candidate."""

    phase: str  # "teacher" | "train"
    dtype: str  # "float32" | "bfloat16" | "float16"; the teacher's: its name, "torch bfloat16" | "onnx int8-wo" | ...
    tokens_per_s: dict  # candidate dtype -> measured tokens/s ({} when the user fixed the dtype)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if not self.tokens_per_s:
            return f"{self.phase}: {self.dtype} (as asked)"
        rates = ", ".join(f"{name} {rate:,.0f}" for name, rate in sorted(self.tokens_per_s.items()))
        return f"{self.phase}: {self.dtype} (measured tokens/s: {rates})"


def resolve_device(device: str) -> torch.device:
    """auto = CUDA when torch sees a GPU, else CPU. Asking for cuda without one is a usage error upstream."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def candidates(device: torch.device) -> list[str]:
    """fp16 only on GPUs: on CPUs torch runs it through fp32 conversions, never faster than fp32 itself."""
    return ["float32", "bfloat16", "float16"] if device.type == "cuda" else ["float32", "bfloat16"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(call: Callable[[], int], device: torch.device) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = call()
    _sync(device)
    return tokens, time.perf_counter() - t0


def compare(calls: dict, device: torch.device, seconds: float = PROBE_SECONDS, warm_up: bool = True) -> dict:
    """Tokens/s of each call (name -> call returning the tokens it processed), medians of calls taken in
    turn (A B A B ...), so a machine whose speed drifts (other jobs, turbo) shifts all alike.

    Each call runs once first, untimed (kernel creation, caches). A call whose first run took EMULATED_FACTOR
    times the fastest one's and over `seconds` (an emulated precision) is not run again: that run is its
    measurement. The others take turns: at least PROBE_MIN_ROUNDS rounds, or one when a call is longer than
    `seconds`, until each had about `seconds`. `warm_up=False` (calls already warm): the first runs count as the
    first round, so calls longer than `seconds` run once each."""
    first = {name: _timed(call, device) for name, call in calls.items()}
    fastest = min(dt for _, dt in first.values())
    rates: dict = {name: [] for name in calls}
    repeat = []
    if not warm_up:  # the first runs are the first round; short calls take more turns
        for name, (tokens, dt) in first.items():
            rates[name].append(tokens / dt)
        repeat = [] if all(dt >= seconds for _, dt in first.values()) else list(calls)
    else:
        for name, (tokens, dt) in first.items():
            if dt >= seconds and dt >= EMULATED_FACTOR * fastest:
                rates[name].append(tokens / dt)
            else:
                repeat.append(name)
    min_rounds = 1 if any(first[name][1] >= seconds for name in repeat) else PROBE_MIN_ROUNDS
    spent, rounds = 0.0, 0
    while repeat and rounds < PROBE_MAX_ROUNDS and (rounds < min_rounds or spent < seconds * len(repeat)):
        for name in repeat:
            tokens, dt = _timed(calls[name], device)
            spent += dt
            rates[name].append(tokens / dt)
        rounds += 1
    return {name: round(statistics.median(values), 1) for name, values in rates.items()}


def choose_precision(phase: str, requested: str, device: torch.device, make_call: Callable[[str], Callable[[], int]],
                     options: Optional[list[str]] = None, measure: Callable[..., dict] = compare,
                     names: Optional[list[str]] = None) -> PrecisionChoice:
    """`requested` is a dtype name or "auto"; `make_call(dtype)` gives a call doing the phase's real work
    in that dtype (returning the tokens it processed); `options` narrows the device's candidates; `names` replaces
    them (the teacher's candidates are teachers, distill/teachers.py)."""
    if requested != "auto":
        return PrecisionChoice(phase, requested, {})
    names = names or [name for name in candidates(device) if options is None or name in options]
    rates = measure({name: make_call(name) for name in names}, device)
    return PrecisionChoice(phase, max(rates, key=rates.get), rates)
