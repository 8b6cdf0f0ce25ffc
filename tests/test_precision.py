"""Precision chosen by measurement, and a lower ISA exercised in every test run.

The forced-ISA test runs a quick subset of the suite in a subprocess that sees an AVX2-only machine
(ATEN_CPU_CAPABILITY=avx2 for torch's own kernels, ONEDNN_MAX_CPU_ISA=AVX2 for oneDNN's, numpy's
AVX-512 dispatch targets disabled), so code tuned on an AVX-512/BF16 CPU is checked on AVX2 paths too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specpipe.distill.precision import PrecisionChoice, candidates, choose_precision, compare

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


def _given(rates: dict):
    """A `measure` that returns fixed rates for whatever candidates it is asked about."""
    return lambda calls, device: {name: rates[name] for name in calls}


def test_auto_takes_the_faster_candidate_and_records_every_rate():
    rates = {"float32": 50.0, "bfloat16": 9.0}
    choice = choose_precision("teacher", "auto", CPU, str, measure=_given(rates))
    assert choice == PrecisionChoice("teacher", "float32", rates)
    rates = {"float32": 50.0, "bfloat16": 90.0}
    choice = choose_precision("train", "auto", CPU, str, measure=_given(rates))
    assert choice.dtype == "bfloat16" and "bfloat16 90" in choice.describe()


def test_a_given_precision_is_not_measured():
    def measure(calls, device):
        raise AssertionError("measured although the precision was given")

    assert choose_precision("train", "bfloat16", CPU, str, measure=measure) == PrecisionChoice("train", "bfloat16", {})


def test_candidates_follow_the_device_and_the_phase():
    assert candidates(CPU) == ["float32", "bfloat16"]  # fp16 on a CPU is converted through fp32: never faster
    assert "float16" in candidates(torch.device("cuda"))
    seen = []
    choose_precision("train", "auto", torch.device("cuda"), str, options=["float32", "bfloat16"],
                     measure=lambda calls, device: seen.extend(calls) or {name: 1.0 for name in calls})
    assert seen == ["float32", "bfloat16"]


class _Clock:
    """perf_counter for compare(): each call of a `work` takes its seconds of this clock's time."""

    def __init__(self):
        self.now, self.log = 0.0, []

    def perf_counter(self) -> float:
        return self.now

    def work(self, name: str, seconds: float, tokens: int):
        def call() -> int:
            self.now += seconds
            self.log.append(name)
            return tokens

        return call


def test_compare_alternates_candidates_and_reports_tokens_per_second(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("specpipe.distill.precision.time", clock)
    rates = compare({"a": clock.work("a", 0.01, 10), "b": clock.work("b", 0.02, 10)}, CPU, seconds=0.05)
    assert rates == {"a": pytest.approx(1000.0), "b": pytest.approx(500.0)}
    assert clock.log[:6] == ["a", "b", "a", "b", "a", "b"]  # warm-ups, then turns


def test_a_candidate_slower_than_the_budget_runs_once(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("specpipe.distill.precision.time", clock)
    rates = compare({"fast": clock.work("fast", 0.01, 10), "emulated": clock.work("emulated", 2.0, 3)}, CPU, seconds=1.0)
    assert clock.log.count("emulated") == 1 and rates["emulated"] == pytest.approx(1.5)
    assert clock.log.count("fast") > 3


def _smollm2_shaped_model():
    """Random weights with SmolLM2-135M's layer shapes (2 of its 30 layers, a smaller vocabulary): the
    matmul shapes the real teacher probe times, built in a second."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=8192)
    return LlamaForCausalLM(config).eval()


def test_auto_precision_on_this_isa():
    """Where torch runs AVX2 code (this CPU's, or forced), bf16 is emulated and auto must pick fp32.
    Elsewhere the choice is whichever measured faster."""
    from specpipe.distill.run import _Teachers

    teachers = _Teachers(_smollm2_shaped_model(), CPU)
    prompts = [list(range(10, 30)), list(range(40, 60))]
    choice = choose_precision("teacher", "auto", CPU, lambda dtype: teachers.probe(dtype, prompts))
    assert set(choice.tokens_per_s) == {"float32", "bfloat16"}
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"):
        assert choice.dtype == "float32", choice.describe()
    else:
        assert choice.dtype == max(choice.tokens_per_s, key=choice.tokens_per_s.get)


def forced_avx2_env() -> dict:
    """The environment that makes torch, oneDNN and numpy run their AVX2 code on any newer x86 CPU.
    Values from each library's docs: ATEN_CPU_CAPABILITY (default|avx2|avx512), ONEDNN_MAX_CPU_ISA
    (oneDNN "CPU dispatcher control"), NPY_DISABLE_CPU_FEATURES (numpy "CPU/SIMD optimizations":
    dispatch targets named as numpy names them; disabling one this CPU lacks is a no-op)."""
    from specpipe.machine import numpy_cpu_tables

    avx512 = [name for name in numpy_cpu_tables()[2] if name.startswith("AVX512")]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if avx512:
        env["NPY_DISABLE_CPU_FEATURES"] = " ".join(avx512)
    return env


# Distillation on the tiny pair, greedy decoding equivalence, the sampling transforms and the acceptance
# rule, and the precision chooser: quick, and the places where ISA-dependent rounding would show.
FORCED_ISA_SUBSET = [
    "tests/test_precision.py::test_auto_precision_on_this_isa",
    "tests/test_precision.py::test_the_forced_isa_is_in_effect",
    "tests/test_distill.py::test_training_learns_from_the_teacher",
    "tests/test_verify.py",
    "tests/test_decoding.py",
]


def test_the_forced_isa_is_in_effect():
    if os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        assert torch.backends.cpu.get_cpu_capability() != ""
        return
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    from specpipe.machine import numpy_cpu_tables

    assert not any(on for name, on in numpy_cpu_tables()[0].items() if name.startswith("AVX512"))


def test_the_quick_subset_passes_with_avx2_forced():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "not chi_square and not sampling_matches",
         *FORCED_ISA_SUBSET],
        cwd=ROOT, env=forced_avx2_env(), capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1]
