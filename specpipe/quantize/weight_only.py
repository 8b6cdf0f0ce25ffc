"""Weight-only int8 / int4: ONNX Runtime's MatMulNBits quantizer (group-wise round-to-nearest).

MatMulNBits is ONNX Runtime's fast CPU path for LLM decoding: the weights stay packed in 4 or 8 bits
and are dequantized inside the kernel, so a decode step reads ~1/8 (int4) of the fp32 bytes.
accuracy_level 4 lets the kernel quantize the activations to int8 on the fly (per block of each row) and
use integer dot products (VNNI where the CPU has it, AVX2's vpmaddubsw otherwise). accuracy_level 1 (fp32
activations) is not a fast path in ONNX Runtime 1.32 on AVX2: SmolLM2 int4-wo ran ~20x and int8-wo ~45x
slower per token (2026-11-22, loaded machine). Level 4's 1-row kernels round differently from its
multi-row ones (logits moved by up to 1.8 on SmolLM2); a target therefore runs its 1-token steps as
2-row calls (engines/onnxruntime.py), which makes decode and verify bit-identical.

Recipes (measured on SmolLM2-135M, see docs/quantization.md):
- the lm_head stays at 8 bits in int4-wo: it is the embedding matrix too (tied), the most sensitive
  layer, and at 8 bits it costs ~14 MB more than at 4; llama.cpp keeps its output layer at 6-8 bits
  for the same reason.
- int4 is asymmetric (uint4 with a zero point per group): better top-1 agreement and perplexity than
  symmetric at the same speed. MatMulNBits also takes float zero points (as HQQ writes them), which
  are more accurate still, but ONNX Runtime 1.31 then leaves its fast kernel: 15x slower per token.
"""

from __future__ import annotations

import dataclasses
import logging

from specpipe.quantize.graph import constant_weight_matmuls, lm_head_matmul

ACCURACY_LEVEL_INT8_COMPUTE = 4


@dataclasses.dataclass(frozen=True)
class WeightOnlyRecipe:
    body_bits: int
    head_bits: int
    symmetric: bool


RECIPES = {
    "int8-wo": WeightOnlyRecipe(body_bits=8, head_bits=8, symmetric=True),
    "int4-wo": WeightOnlyRecipe(body_bits=4, head_bits=8, symmetric=False),
}


@dataclasses.dataclass(frozen=True)
class BuilderRecipe:
    """A weight-only mode as onnxruntime-genai's model builder makes it (the shared-KV target graph):
    its `--precision` and `--extra_options`, spelled as onnxruntime-genai 0.18 spells them."""

    precision: str
    extra_options: tuple[tuple[str, str], ...]

    def options(self, group_size: int) -> dict[str, str]:
        return {**dict(self.extra_options), "block_size": str(group_size),
                "accuracy_level": str(ACCURACY_LEVEL_INT8_COMPUTE)}

    def as_dict(self, group_size: int) -> dict:
        return {"quantizer": "onnxruntime-genai model builder", "precision": self.precision,
                "extra_options": self.options(group_size)}


# Measured on SmolLM2-135M (AVX2 EPYC, 2026-11-23, docs/quantization.md, the model builder's table): k_quant
# (llama.cpp's weighted scale/min search) with the lm_head (tied: the embedding too) and llama.cpp's sensitive
# layers at int8 was the most accurate int4 at int4 speed; symmetric int4 with an int4 head ("default") was the
# least.
BUILDER_RECIPES = {
    "int8-wo": BuilderRecipe(precision="int8", extra_options=()),
    "int4-wo": BuilderRecipe(precision="int4", extra_options=(("algo_config", "k_quant_mixed"),)),
}


def recipe_record(mode: str, group_size: int) -> dict:
    """The settings specpipe's own quantizer (`quantize_weight_only`) uses for `mode`, for the manifest."""
    recipe = RECIPES[mode]
    return {"quantizer": "specpipe (onnxruntime MatMulNBitsQuantizer)", "body_bits": recipe.body_bits,
            "head_bits": recipe.head_bits, "symmetric": recipe.symmetric, "block_size": group_size,
            "accuracy_level": ACCURACY_LEVEL_INT8_COMPUTE}


def quantize_weight_only(model, *, mode: str, group_size: int):
    """Quantize every constant-weight MatMul of `model` (an onnx ModelProto) by RECIPES[mode]."""
    recipe = RECIPES[mode]
    head = lm_head_matmul(model)
    body = [name for name in constant_weight_matmuls(model) if name != head]
    if head is None or recipe.head_bits == recipe.body_bits:
        return _quantize(model, bits=recipe.body_bits, symmetric=recipe.symmetric, group_size=group_size, exclude=[])
    model = _quantize(model, bits=recipe.body_bits, symmetric=recipe.symmetric, group_size=group_size, exclude=[head])
    return _quantize(model, bits=recipe.head_bits, symmetric=True, group_size=group_size, exclude=body)


def _quantize(model, *, bits: int, symmetric: bool, group_size: int, exclude: list[str]):
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits
    from onnxruntime.quantization.quant_utils import QuantFormat

    config = nbits.DefaultWeightOnlyQuantConfig(
        block_size=group_size,
        is_symmetric=symmetric,
        accuracy_level=ACCURACY_LEVEL_INT8_COMPUTE,
        quant_format=QuantFormat.QOperator,
        op_types_to_quantize=("MatMul",),
        bits=bits,
    )
    quantizer = nbits.MatMulNBitsQuantizer(model, algo_config=config, nodes_to_exclude=exclude)
    # The quantizer logs a line per node at INFO; the caller reports the summary.
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    previous = logger.level
    logger.setLevel(logging.WARNING)
    try:
        quantizer.process()
    finally:
        logger.setLevel(previous)
    return quantizer.model.model
