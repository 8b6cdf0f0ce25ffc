"""`--backend tensorrt`: the ONNX graph specpipe exports (optimum, text-generation-with-past) -> a TensorRT
engine (`model.plan`) with three optimization profiles, one per call shape of the speculative decoder.

    prefill  a prompt (or a long catch-up) on top of any cache         new tokens 1..max_input_len
    decode   one token: the draft's steps, target-only decoding         new tokens 1
    verify   the last context token + K drafts, scored in one call      new tokens 2..K+1

Each profile covers every past length 0..max_seq_len-new, so any call the decoder makes has a profile;
`select_profile` picks the narrowest. The network is always strongly typed: precision lives in the graph
(TensorRT 11 removed the fp16/int8/fp8 builder flags). fp16/bf16 come from ModelOpt AutoCast before the
build; fp8/int8 from the Q/DQ nodes of specpipe's quantizer. Upstream API names: specpipe/engines/upstream.py.

Pure functions (profiles, tensor shapes) run anywhere; `build_engine` and `autocast` import tensorrt /
modelopt lazily and need CUDA.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from specpipe.checkpoint.facts import ModelShape
from specpipe.errors import EngineError

PLAN_FILE = "model.plan"
ProfileName = Literal["prefill", "decode", "verify"]
PROFILE_ORDER: tuple[ProfileName, ...] = ("prefill", "decode", "verify")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DimRange(_Frozen):
    """min <= opt <= max for one dynamic dimension."""

    min: int
    opt: int
    max: int


class ShapeRange(_Frozen):
    """IOptimizationProfile.set_shape(input, min, opt, max) arguments for one input."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


class Profile(_Frozen):
    name: ProfileName
    new_tokens: DimRange
    past_tokens: DimRange
    shapes: dict[str, ShapeRange]


def input_names(layers: int) -> list[str]:
    """Inputs of optimum's text-generation-with-past graph (see specpipe/engines/onnxruntime.py)."""
    names = ["input_ids", "attention_mask", "position_ids"]
    for i in range(layers):
        names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    return names


def output_names(layers: int) -> list[str]:
    names = ["logits"]
    for i in range(layers):
        names += [f"present.{i}.key", f"present.{i}.value"]
    return names


def optimization_profiles(shape: ModelShape, *, max_seq_len: int, max_input_len: int, max_draft_len: int) -> list[Profile]:
    """The prefill / decode / verify profiles for batch 1 (one sequence per call, as the decoder runs)."""
    if max_seq_len < max_draft_len + 2:
        raise ValueError(f"max_seq_len {max_seq_len} leaves no room for K = {max_draft_len} drafts")
    prefill_max = min(max_input_len, max_seq_len)
    mid = max_seq_len // 2
    ranges = {
        #          new tokens                                           past tokens
        "prefill": (DimRange(min=1, opt=min(128, prefill_max), max=prefill_max), DimRange(min=0, opt=0, max=max_seq_len - 1)),
        "decode": (DimRange(min=1, opt=1, max=1), DimRange(min=0, opt=mid, max=max_seq_len - 1)),
        "verify": (
            DimRange(min=2, opt=max_draft_len + 1, max=max_draft_len + 1),
            DimRange(min=0, opt=mid, max=max_seq_len - 2),
        ),
    }
    return [_profile(name, *ranges[name], shape=shape, max_seq_len=max_seq_len) for name in PROFILE_ORDER]


def _profile(name: ProfileName, new: DimRange, past: DimRange, *, shape: ModelShape, max_seq_len: int) -> Profile:
    def total(a: int, b: int) -> int:
        return min(a + b, max_seq_len)

    tokens = ShapeRange(min=(1, new.min), opt=(1, new.opt), max=(1, new.max))  # [batch, new]
    shapes = {
        "input_ids": tokens,
        "position_ids": tokens,
        # [batch, past + new]: the mask covers the cache and the new tokens
        "attention_mask": ShapeRange(
            min=(1, new.min + past.min), opt=(1, total(new.opt, past.opt)), max=(1, total(new.max, past.max))
        ),
    }
    kv = ShapeRange(  # [batch, kv_heads, past, head_dim]
        min=(1, shape.kv_heads, past.min, shape.head_dim),
        opt=(1, shape.kv_heads, past.opt, shape.head_dim),
        max=(1, shape.kv_heads, past.max, shape.head_dim),
    )
    for i in range(shape.layers):
        shapes[f"past_key_values.{i}.key"] = kv
        shapes[f"past_key_values.{i}.value"] = kv
    return Profile(name=name, new_tokens=new, past_tokens=past, shapes=shapes)


def select_profile(profiles: list[Profile], new_tokens: int, past_tokens: int) -> int:
    """Index of the narrowest profile that covers a call of `new_tokens` on a `past_tokens` cache."""
    fitting = [
        (p.new_tokens.max - p.new_tokens.min, i)
        for i, p in enumerate(profiles)
        if p.new_tokens.min <= new_tokens <= p.new_tokens.max and p.past_tokens.min <= past_tokens <= p.past_tokens.max
    ]
    if not fitting:
        raise EngineError(f"no optimization profile covers {new_tokens} new tokens on a {past_tokens}-token cache")
    return min(fitting)[1]


# ---- real steps (CUDA + tensorrt / modelopt) -------------------------------------------------------------


def autocast(src_onnx: Path, dst_dir: Path, dtype: str) -> Path:
    """fp32 graph -> fp16/bf16 mixed precision with ModelOpt AutoCast (keeps sensitive nodes in fp32).

    I/O types follow the graph (keep_io_types=False), so the KV cache crosses the engine boundary in the
    low precision: half the bytes per step. The engine reads its I/O dtypes from the plan.
    """
    import onnx
    from modelopt.onnx.autocast import convert_to_mixed_precision

    from specpipe.engines.upstream import AUTOCAST_LOW_PRECISION

    model = convert_to_mixed_precision(onnx_path=str(src_onnx), low_precision_type=AUTOCAST_LOW_PRECISION[dtype], keep_io_types=False)
    dst_dir.mkdir(parents=True, exist_ok=True)
    out = dst_dir / "model.onnx"
    # protobuf caps a message at 2 GB: weights go to a side file, as optimum's export does
    onnx.save(model, str(out), save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data")
    return out


def build_engine(onnx_path: Path, out_dir: Path, profiles: list[Profile], *, workspace_gb: float = 4.0) -> Path:
    """Parse the ONNX graph (external weights next to it), add the profiles, write out_dir/model.plan."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # required for fp8 Q/DQ on TensorRT 10.x; accepted and always on in 11.x
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT cannot parse {onnx_path}: {errors}")
    present = {network.get_input(i).name for i in range(network.num_inputs)}
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    for profile in profiles:
        trt_profile = builder.create_optimization_profile()
        for name, rng in profile.shapes.items():
            if name in present:  # graphs exported without position_ids simply lack it
                trt_profile.set_shape(name, rng.min, rng.opt, rng.max)
        config.add_optimization_profile(trt_profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineError(f"TensorRT could not build an engine from {onnx_path} (see the TensorRT log above)")
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = out_dir / PLAN_FILE
    plan.write_bytes(bytes(serialized))
    return plan


def write_tensorrt_meta(
    folder: Path, shape: ModelShape, profiles: list[Profile], *, max_seq_len: int, max_draft_len: int, precision: str, quant: str
) -> None:
    """engine.json for specpipe.engines.tensorrt.TensorRTEngine (load_engine dispatches on `backend`)."""
    meta = {
        "backend": "tensorrt",
        "plan": PLAN_FILE,
        "vocab_size": shape.vocab,
        "num_layers": shape.layers,
        "num_kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "max_seq_len": max_seq_len,
        "max_draft_len": max_draft_len,
        "precision": precision,
        "quant": quant,
        "profiles": [p.model_dump(mode="json") for p in profiles],
    }
    (Path(folder) / "engine.json").write_text(json.dumps(meta, indent=2) + "\n")
