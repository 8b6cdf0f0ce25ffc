"""Quantized engines: int8 / int4 weight-only, int8 W8A8, fp8 QDQ, each held to a measured accuracy budget.

Stage order: export (fp32 ONNX) -> quantize (this package) -> engine. See `pipeline.quantize_engine`.
"""

from specpipe.contract.quant import AccuracyReport
from specpipe.quantize.accuracy import BudgetViolation, check_budget, greedy_agreement, measure_accuracy
from specpipe.quantize.pipeline import MODE_HELP, QuantResult, check_kv_cache_dtype, quantize_engine, quantize_onnx

__all__ = [
    "AccuracyReport",
    "BudgetViolation",
    "MODE_HELP",
    "QuantResult",
    "check_budget",
    "check_kv_cache_dtype",
    "greedy_agreement",
    "measure_accuracy",
    "quantize_engine",
    "quantize_onnx",
]
