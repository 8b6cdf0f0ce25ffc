"""Test-only: break a quantized engine on purpose, so tests can show the accuracy budget catches it.

Never called by the build. Every dequantizing node (DequantizeLinear, MatMulNBits, and the weight side of
MatMulIntegerToFloat, ORT's fused int8 kernel) gets its scale
multiplied by `factor`, so what it reconstructs is `factor` times too large. A Q/DQ pair shares one scale
initializer, and scaling that shared tensor would cancel out; each dequantizer gets its own copy instead.
"""

from __future__ import annotations

from pathlib import Path

from specpipe.quantize.graph import load_model, save_model

SCALE_INPUT = {"DequantizeLinear": 1, "MatMulNBits": 2, "MatMulIntegerToFloat": 3}  # op type -> its (weight) scale input


def scale_quantization_scales(folder: Path, factor: float = 10.0) -> int:
    """Scale what the engine graph in `folder` dequantizes by `factor`. Returns how many nodes changed."""
    from onnx import numpy_helper

    model = load_model(folder)
    initializers = {init.name: init for init in model.graph.initializer}
    changed = 0
    for node in model.graph.node:
        index = SCALE_INPUT.get(node.op_type)
        if index is None or node.input[index] not in initializers:
            continue
        scale = numpy_helper.to_array(initializers[node.input[index]])
        tampered = numpy_helper.from_array((scale * factor).astype(scale.dtype), f"{node.input[index]}_tampered_{changed}")
        model.graph.initializer.append(tampered)
        node.input[index] = tampered.name
        changed += 1
    if not changed:
        raise ValueError(f"{folder}: no dequantization scales to tamper with")
    save_model(model, folder)
    return changed
