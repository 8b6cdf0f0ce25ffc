"""How an engine is quantized and what its accuracy against the unquantized engine came to: what the builder
asks of quantize, what the manifest records, and what the gate holds to a budget."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, field_validator

from specpipe.config import Strict


QuantMode = Literal["none", "int8-wo", "int4-wo", "int8", "fp8"]  # how an engine is quantized


# --quant may also be `auto`: the build makes the target in fp32 and as each of AUTO_QUANT_CANDIDATES, measures
# every one's accuracy and speed on this machine, and keeps the one the serving load runs fastest within the
# accuracy budget (builder/quant_choice.py states the rule).
QuantChoice = Literal["none", "int8-wo", "int4-wo", "int8", "fp8", "auto"]


AUTO_QUANT_CANDIDATES = ("int8-wo", "int4-wo")  # besides fp32: the weight-only modes ONNX Runtime runs fast on CPU


KvCacheDtype = Literal["auto", "fp8", "int8"]


class AccuracyBudget(Strict):
    """How far a quantized engine may drift from the unquantized engine of the same model.

    Measured teacher-forced on held-out text and prompts disjoint from the calibration set
    (specpipe.quantize.accuracy). Relative perplexity change = ppl_quant / ppl_ref - 1.
    """

    max_ppl_increase: float = Field(0.05, ge=0.0, description="largest relative perplexity increase (0.05 = +5%)")
    min_top1_agreement: float = Field(0.9, ge=0.0, le=1.0, description="smallest share of positions whose argmax matches")
    max_mean_kl: Optional[float] = Field(None, gt=0.0, description="largest mean KL(p_ref || p_quant) in nats; None = report only")


# Weights per MatMulNBits block, by mode. int8-wo: 64, measured (docs/quantization.md, "int8-wo's block size"): on
# SmolLM2-135M's builder graph (Zen 4, VNNI) a one-row step, median over 6-8 processes (one process's numbers move
# ±10% with where the weights land), took 7.53 ms at 32, 6.46 at 64, 6.15 at 128 (2 threads; 1 thread 10.61 / 9.2 /
# 8.35), with top-1 agreement against fp32 0.976 / 0.960 / 0.927 and mean KL 0.006 / 0.011 / 0.019: 64 buys most of
# the speed inside the accuracy budget at half 128's KL, and a hidden size of 576 is no multiple of 128 (padded
# blocks). MLAS pays per block (a scaled partial sum per block of int8 products), so fewer blocks cost less on any
# ISA; accuracy depends on the weights, not the CPU. int4-wo: 32, as measured for its recipe (k_quant_mixed).
DEFAULT_GROUP_SIZE = {"int8-wo": 64, "int4-wo": 32}


class QuantConfig(Strict):
    """How one engine (target or draft) is quantized; `mode` none keeps fp32.

    int8-wo / int4-wo: weight-only, ONNX Runtime MatMulNBits, group-wise. On the model builder's graph the
    builder quantizes (specpipe.quantize.weight_only.BUILDER_RECIPES: int4 k-quant with the lm_head and the
    sensitive layers at int8); on optimum's graph specpipe does (RECIPES: int4 asymmetric, lm_head at int8).
    int8: W8A8 QDQ, per-channel weights, per-tensor activation scales calibrated on prompts.
    fp8: E4M3 weights and activations as QDQ with calibrated scales; ONNX Runtime on CPU emulates
    it (that is how accuracy is checked here), TensorRT on Hopper/Ada runs the same graph natively.
    auto (a CPU target only): fp32 or one of AUTO_QUANT_CANDIDATES, whichever decodes the most tokens per second
    at the server's full batch within the budget (builder/quant_choice.py).
    """

    mode: QuantChoice = "none"
    group_size: Optional[int] = Field(
        None, ge=16, description="weight-only: weights per quantization group (power of 2, >= 16); default: the "
        "mode's own (int8-wo 64, int4-wo 32: DEFAULT_GROUP_SIZE)")
    calib_prompts: Optional[Path] = Field(None, description="JSONL with {\"prompt\": ...} lines; None = the packaged set")
    calib_size: int = Field(64, ge=1, description="calibration prompts used for int8 / fp8")
    calib_window: int = Field(128, ge=8, description="tokens per calibration run (prompts are packed into windows)")
    smooth_quant: bool = Field(False, description="int8: SmoothQuant smoothing before quantizing (needs neural-compressor)")
    kv_cache_dtype: KvCacheDtype = Field("auto", description="KV cache precision; fp8/int8 need an engine that stores it so")
    budget: AccuracyBudget = Field(default_factory=AccuracyBudget)
    accept_accuracy_loss: bool = Field(False, description="keep an engine that is over its accuracy budget")

    @field_validator("group_size")
    @classmethod
    def _group_size_is_a_power_of_two(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and v & (v - 1):
            raise ValueError(f"group size must be a power of 2 (MatMulNBits block size), got {v}")
        return v

    @property
    def block_size(self) -> int:
        """The group size a weight-only mode quantizes with: --group-size, else the mode's default."""
        return self.group_size or DEFAULT_GROUP_SIZE.get(self.mode, DEFAULT_GROUP_SIZE["int4-wo"])

    @property
    def needs_calibration(self) -> bool:
        return self.mode in ("int8", "fp8")


@dataclasses.dataclass(frozen=True)
class AccuracyReport:
    mode: str
    num_sequences: int
    num_positions: int
    ppl_ref: float
    ppl_quant: float
    ppl_rel_change: float
    top1_agreement: float
    mean_kl: float
    max_kl: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
