"""Test-only: break a quantized engine on purpose, so tests can show the accuracy budget catches it.

Never called by the build. Multiplying every quantization scale by `factor` scales the dequantized
weights by the same factor (weight-only and QDQ alike), which a working budget check must reject.
"""

from __future__ import annotations

from pathlib import Path

from specpipe.quantize.graph import load_model, save_model

SCALE_SUFFIXES = ("_scale", "_scales")


def scale_quantization_scales(folder: Path, factor: float = 10.0) -> int:
    """Multiply the scale initializers of the engine graph in `folder` by `factor`. Returns how many."""
    from onnx import numpy_helper

    model = load_model(folder)
    scaled = 0
    for index, init in enumerate(model.graph.initializer):
        if init.name.endswith(SCALE_SUFFIXES):
            array = numpy_helper.to_array(init)
            model.graph.initializer[index].CopyFrom(numpy_helper.from_array((array * factor).astype(array.dtype), init.name))
            scaled += 1
    if not scaled:
        raise ValueError(f"{folder}: no quantization scales to tamper with")
    save_model(model, folder)
    return scaled
