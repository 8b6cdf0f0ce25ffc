"""Weights and activations quantized with calibrated scales: int8 (W8A8) and fp8 (E4M3), as QDQ graphs.

Both go through onnxruntime.quantization.quantize_static in QDQ format: QuantizeLinear/DequantizeLinear
pairs around the linear layers (the constant-weight MatMuls, lm_head included once untied), weights
per output channel, activation scales from running calibration prompts through the model.

- int8: ONNX Runtime on CPU fuses each DQ -> MatMul into MatMulIntegerToFloat (real int8 compute).
  Activations are quantized per tensor, statically: LLM activation outliers make that lossy, which is
  what SmoothQuant (--smooth-quant, needs the `smoothquant` extra) moves into the weights.
- fp8: ONNX Runtime on CPU has no fp8 MatMul. The saved CPU engine holds the fp8-rounded weights as fp32
  and keeps fp8 Q/DQ on the activations: an exact emulation, so accuracy is measured faithfully but
  nothing gets faster. TensorRT on Hopper/Ada runs such a QDQ graph natively in fp8 (the GPU build makes
  its own with NVIDIA ModelOpt, whose ONNX fp8 recipe, amax / 448 scales, is the one used here too).

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

import numpy as np

from specpipe.errors import UsageError
from specpipe.quantize.calibration import KvCalibrationReader
from specpipe.quantize.graph import MODEL_FILE, PROTOBUF_LIMIT, constant_weight_matmuls, save_model

# How ONNX Runtime's optimizer must be run on each calibrated graph before it is saved as the engine.
# - int8: ORT merges the per-consumer Q/DQ pairs back into one (common subexpression elimination runs
#   before the QDQ fusions), and a DQ with several consumers is not fused into MatMulIntegerToFloat.
# - fp8: ORT 1.31 fuses fp8 Q/DQ around a MatMul into a QLinearMatMul, which has no fp8 kernel (the
#   session fails to load); with QDQ fusions off, the fp8 weights are folded to fp32 (exact fp8 values)
#   and the activations keep their Q/DQ pairs: an exact emulation.
ORT_OPTIMIZER_SETTINGS = {
    "int8": {"disabled_optimizers": ("CommonSubexpressionElimination",)},
    "fp8": {"config": {"session.disable_quant_qdq": "1"}},
}
SMOOTH_QUANT_ALPHA = 0.5  # SmoothQuant's default migration strength
FP8_MIN_OPSET = 19
E4M3_MAX = 448.0


def smooth_quant_available() -> bool:
    """ORT's SmoothQuant option imports Intel Neural Compressor 2.x's ONNX adaptor."""
    try:
        import neural_compressor.adaptor.ox_utils.smooth_quant  # noqa: F401
    except Exception:
        return False
    return True


def quantize_calibrated(
    model, out_dir: Path, *, mode: str, calib: Sequence[Sequence[int]], window: int, smooth_quant: bool,
    symmetric_activations: bool = False,
) -> None:
    """Write out_dir/model.onnx: `model` (an onnx ModelProto) quantized as `mode` ('int8' or 'fp8').

    symmetric_activations: int8 activation zero points fixed at 0, for TensorRT, whose quantize layer takes no
    other (ONNX Runtime on CPU handles asymmetric ones, which use the int8 range better, so the CPU build keeps
    them). fp8 zero points are 0 either way.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    if smooth_quant and mode != "int8":
        raise UsageError("SmoothQuant smoothing applies to int8 (W8A8) only")
    if smooth_quant and not smooth_quant_available():
        raise UsageError(
            "--smooth-quant needs Intel Neural Compressor 2.x, which ONNX Runtime's SmoothQuant imports:"
            " pip install 'specpipe[smoothquant]'"
        )
    if mode == "int8":
        qtype, method = QuantType.QInt8, CalibrationMethod.MinMax
    else:
        # ORT accepts only the Distribution calibrator for float8; its scales are replaced (_fp8_amax_scales).
        qtype, method = QuantType.QFLOAT8E4M3FN, CalibrationMethod.Distribution
    extra_options = {
        "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1},  # one weight scale per output channel
        # Quantize what a W8A8 / fp8 GEMM reads (its two inputs); its output stays fp32 (the GEMM accumulates
        # in higher precision). By default ORT would also put a Q/DQ pair on the output, whose range is
        # never calibrated for fp8 and costs accuracy for int8.
        "OpTypesToExcludeOutputQuantization": ["MatMul"],
        # One Q/DQ pair per consumer: ORT fuses DQ -> MatMul into an integer kernel (MatMulIntegerToFloat)
        # only when the DQ feeds that MatMul alone. With q/k/v (and gate/up) sharing one pair, 150 of
        # SmolLM2's 211 layers stayed dequantize-then-fp32 and a token took 7x longer than with SmoothQuant.
        "DedicatedQDQPair": True,
    }
    if smooth_quant:
        extra_options.update(SmoothQuant=True, SmoothQuantAlpha=SMOOTH_QUANT_ALPHA)
    if symmetric_activations and mode == "int8":
        extra_options["ActivationSymmetric"] = True
    if mode == "fp8":
        _relabel_opset(model, FP8_MIN_OPSET)
    model = _with_tensor_types(model)
    linear_layers = constant_weight_matmuls(model)
    large = model.ByteSize() > PROTOBUF_LIMIT
    reader = KvCalibrationReader(model, calib, window=window)
    with tempfile.TemporaryDirectory(prefix="specpipe-quant-") as tmp:
        # quantize_static wants a path: save the (untied) graph, and let it write next to it.
        src_path = Path(tmp) / "src" / MODEL_FILE
        save_model(model, src_path.parent)
        cache_path = None
        if mode == "fp8":
            cache_path = Path(tmp) / "calibration.json"
            extra_options["TensorQuantOverrides"] = _fp8_amax_scales(model, src_path, reader, linear_layers, cache_path)
        with _quiet():
            quantize_static(
                str(src_path),
                str(Path(out_dir) / MODEL_FILE),
                reader,
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=["MatMul"],
                nodes_to_quantize=linear_layers,
                per_channel=True,
                activation_type=qtype,
                weight_type=qtype,
                calibrate_method=method,
                calibration_cache_path=cache_path,
                use_external_data_format=large,
                extra_options=extra_options,
            )


def _fp8_amax_scales(model, model_path: Path, reader, linear_layers: list[str], cache_path: Path) -> dict:
    """fp8 scales = amax / 448 (E4M3's largest value): per tensor for activations, per output channel for weights.

    This is the recipe TensorRT and NVIDIA ModelOpt use. ORT's own fp8 rule matches the standard deviation of
    the values to that of the E4M3 grid instead, which clips LLM activation outliers (~4 std): on SmolLM2 it
    raised perplexity 60x. ORT still calibrates (its Distribution calibrator, whose histogram edges give
    amax); its result is saved as the calibration cache so quantize_static does not run it a second time, and
    the scales are handed over as TensorQuantOverrides.
    """
    from ml_dtypes import float8_e4m3fn
    from onnx import numpy_helper
    from onnxruntime.quantization import CalibrationMethod, create_calibrator
    from onnxruntime.quantization.calibrate import save_tensors_data

    with _quiet():
        calibrator = create_calibrator(
            model_path,
            ["MatMul"],
            augmented_model_path=str(cache_path.with_name("augmented.onnx")),
            calibrate_method=CalibrationMethod.Distribution,
            use_external_data_format=True,
        )
        calibrator.collect_data(reader)
        tensors = calibrator.compute_data()
    reader.rewind()
    save_tensors_data(tensors, cache_path)

    zero = np.array(0, dtype=float8_e4m3fn)
    initializers = {init.name: init for init in model.graph.initializer}
    nodes = {node.name: node for node in model.graph.node}
    overrides: dict[str, list[dict]] = {}
    for name in linear_layers:
        activation, weight = nodes[name].input[0], nodes[name].input[1]
        amax = max(abs(float(tensors[activation].range_value[0])), abs(float(tensors[activation].range_value[1])))
        overrides[activation] = [{"scale": np.array(max(amax, 1e-12) / E4M3_MAX, np.float32), "zero_point": zero}]
        column_amax = np.abs(numpy_helper.to_array(initializers[weight])).max(axis=0)  # [K, N] -> [N]
        overrides[weight] = [
            {"axis": 1, "scale": np.array(max(float(a), 1e-12) / E4M3_MAX, np.float32), "zero_point": zero}
            for a in column_amax
        ]
    return overrides


def _with_tensor_types(model):
    """`model` with the type and shape of every intermediate tensor declared (graph.value_info).

    The calibrators and the QDQ quantizer only touch tensors whose type they know. ONNX's own shape
    inference stops at ONNX Runtime's ops (SimplifiedLayerNormalization, QuickGelu... in an ORT-optimized
    engine), which silently left most activations unquantized; ORT's symbolic inference knows them.
    """
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    return SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True)


def _relabel_opset(model, version: int) -> None:
    """Declare ONNX opset `version` (float8 Q/DQ need 19) without running onnx's version converter.

    quantize_static would run the converter, which stops at ONNX Runtime's own ops (the engines are
    ORT-optimized graphs with SimplifiedLayerNormalization etc.). From 18 to 19 the standard ops in these
    graphs only gained float8 types, so relabeling the import keeps their meaning.
    """
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version < version:
            if opset.version < 18:
                raise UsageError(f"fp8 needs an ONNX graph of opset >= 18 (this one is opset {opset.version})")
            opset.version = version


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
