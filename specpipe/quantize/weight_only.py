"""Weight-only int8 / int4: ONNX Runtime's MatMulNBits quantizer (group-wise, symmetric).

MatMulNBits is ONNX Runtime's fast CPU path for LLM decoding: the weights stay packed in 4 or 8 bits
and are dequantized inside the kernel, so a decode step reads ~1/8 (int4) of the fp32 bytes.
accuracy_level 4 lets the kernel quantize the activations to int8 on the fly and use the VNNI dot
products; the weights are still the thing being approximated.
"""

from __future__ import annotations

import logging

WO_BITS = {"int8-wo": 8, "int4-wo": 4}
ACCURACY_LEVEL_INT8_COMPUTE = 4


def quantize_weight_only(model, *, bits: int, group_size: int):
    """Quantize every constant-weight MatMul of `model` (an onnx ModelProto) to `bits`. Returns the new model."""
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits
    from onnxruntime.quantization.quant_utils import QuantFormat

    config = nbits.DefaultWeightOnlyQuantConfig(
        block_size=group_size,
        is_symmetric=True,
        accuracy_level=ACCURACY_LEVEL_INT8_COMPUTE,
        quant_format=QuantFormat.QOperator,
        op_types_to_quantize=("MatMul",),
        bits=bits,
    )
    quantizer = nbits.MatMulNBitsQuantizer(model, algo_config=config)
    # The quantizer logs one INFO line per node it skips; the user only needs the summary we print.
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    previous = logger.level
    logger.setLevel(logging.WARNING)
    try:
        quantizer.process()
    finally:
        logger.setLevel(previous)
    return quantizer.model.model
