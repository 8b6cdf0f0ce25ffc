"""Weights and activations quantized with calibrated scales: int8 (W8A8) and fp8 (E4M3), as QDQ graphs.

Both go through onnxruntime.quantization.quantize_static in QDQ format: QuantizeLinear/DequantizeLinear
pairs around the linear layers (the constant-weight MatMuls, lm_head included once untied), weights
per output channel, activation scales from running calibration prompts through the model.

- int8: ONNX Runtime on CPU fuses the QDQ pairs into integer MatMuls (real int8 compute).
- fp8: ONNX Runtime on CPU has no fp8 MatMul; it runs the Q/DQ pairs in fp32, which emulates the
  rounding exactly, so accuracy is measured faithfully but nothing gets faster. TensorRT on Hopper/Ada
  runs the same graph natively in fp8.

Only the linear layers are quantized: the attention score products (Q.K^T, softmax.V) and norms stay
fp32 here, as in SmoothQuant's W8A8 and TensorRT-LLM's fp8 recipes for the weights' GEMMs.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from pathlib import Path
from typing import Sequence

from specpipe.errors import UsageError
from specpipe.quantize.calibration import KvCalibrationReader
from specpipe.quantize.graph import MODEL_FILE, PROTOBUF_LIMIT, constant_weight_matmuls, save_model

SMOOTH_QUANT_ALPHA = 0.5  # SmoothQuant's default migration strength


def smooth_quant_available() -> bool:
    """ORT's SmoothQuant option imports Intel Neural Compressor 2.x's ONNX adaptor."""
    try:
        import neural_compressor.adaptor.ox_utils.smooth_quant  # noqa: F401
    except Exception:
        return False
    return True


def quantize_calibrated(
    model, out_dir: Path, *, mode: str, calib: Sequence[Sequence[int]], window: int, smooth_quant: bool
) -> None:
    """Write out_dir/model.onnx: `model` (an onnx ModelProto) quantized as `mode` ('int8' or 'fp8')."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    if smooth_quant and mode != "int8":
        raise UsageError("SmoothQuant smoothing applies to int8 (W8A8) only")
    if smooth_quant and not smooth_quant_available():
        raise UsageError(
            "SmoothQuant needs Intel Neural Compressor 2.x (pip install 'neural-compressor<3'); "
            "ONNX Runtime's SmoothQuant option imports its ONNX adaptor"
        )
    if mode == "int8":
        qtype, method = QuantType.QInt8, CalibrationMethod.MinMax
    else:
        # ORT accepts only the Distribution calibrator for float8: it sets the scale from the spread of
        # the values rather than their extreme, so rare outliers do not waste the few fp8 exponents.
        qtype, method = QuantType.QFLOAT8E4M3FN, CalibrationMethod.Distribution
    extra_options = {"QDQOpTypePerChannelSupportToAxis": {"MatMul": 1}}  # one scale per output channel
    if smooth_quant:
        extra_options.update(SmoothQuant=True, SmoothQuantAlpha=SMOOTH_QUANT_ALPHA)
    linear_layers = constant_weight_matmuls(model)
    large = model.ByteSize() > PROTOBUF_LIMIT
    with tempfile.TemporaryDirectory(prefix="specpipe-quant-") as tmp:
        # quantize_static wants a path: save the (untied) graph, and let it write next to it.
        save_model(model, Path(tmp) / "src")
        with _quiet():
            quantize_static(
                str(Path(tmp) / "src" / MODEL_FILE),
                str(Path(out_dir) / MODEL_FILE),
                KvCalibrationReader(model, calib, window=window),
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=["MatMul"],
                nodes_to_quantize=linear_layers,
                per_channel=True,
                activation_type=qtype,
                weight_type=qtype,
                calibrate_method=method,
                use_external_data_format=large,
                extra_options=extra_options,
            )


@contextlib.contextmanager
def _quiet():
    """quantize_static prints a pre-processing hint and per-tensor warnings; keep them off the terminal."""
    level = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(level)
