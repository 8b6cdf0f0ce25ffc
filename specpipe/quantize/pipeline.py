"""Quantize one engine folder into another, then hold it to its accuracy budget.

`quantize_onnx` turns an unquantized engine folder (model.onnx [+ .data] and engine.json, as exported by
optimum for text-generation-with-past) into a quantized one. `quantize_engine` is what the build calls
for each model: calibration data, quantize, measure against the unquantized engine, check the budget,
and return the block the manifest records.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from specpipe.config import THREADS
from specpipe.contract.quant import QuantConfig
from specpipe.errors import UsageError
from specpipe.quantize.graph import (
    constant_weight_matmuls,
    folder_bytes,
    load_model,
    model_files,
    save_model,
    save_ort_optimized,
    untie_lm_head,
)

# KV cache precisions each backend can store. ONNX Runtime's CPU engine keeps the cache in the graph's
# dtype (fp32): an fp8/int8 cache needs kernels that read it (TensorRT / TensorRT-LLM).
KV_CACHE_DTYPES = {"onnxruntime": ("auto",)}

MODE_HELP = (
    "none | int8-wo | int4-wo (weight-only, MatMulNBits: the fast CPU path) | int8 (W8A8, calibrated) | "
    "fp8 (E4M3 QDQ, calibrated; ONNX Runtime on CPU emulates it for the accuracy check, "
    "TensorRT on Hopper/Ada runs it natively) | auto (target only: fp32, int8-wo or int4-wo, whichever decodes "
    "the most tokens/s here at --max-batch-size requests within the accuracy budget)"
)


@dataclasses.dataclass(frozen=True)
class QuantResult:
    mode: str
    quantized_layers: int  # constant-weight MatMuls in the graph handed to the quantizer
    untied_weights: list[str]  # MatMuls given their own constant weight (a tied lm_head)
    group_size: int | None  # weight-only modes
    calib_sequences: int
    calib_tokens: int
    smooth_quant: bool
    src_bytes: int
    dst_bytes: int
    seconds: float
    recipe: dict | None = None  # weight-only modes: which quantizer, with which settings

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_kv_cache_dtype(cfg: QuantConfig, backend: str = "onnxruntime") -> None:
    supported = KV_CACHE_DTYPES.get(backend, ("auto",))
    if cfg.kv_cache_dtype not in supported:
        raise UsageError(
            f"--kv-cache-dtype {cfg.kv_cache_dtype} is not supported by the {backend} engine, which keeps its KV cache"
            " in the model's dtype (fp32); fp8/int8 KV caches need the TensorRT backend"
        )


def check_calibration(cfg: QuantConfig, calib: Sequence[Sequence[int]] | None) -> None:
    if cfg.needs_calibration and not (calib and any(len(ids) > 0 for ids in calib)):
        raise UsageError(
            f"{cfg.mode} quantization calibrates activation scales and needs calibration data:"
            " pass --calib-prompts FILE.jsonl with {\"prompt\": ...} lines (or use a weight-only mode)"
        )


def quantize_onnx(src_dir: Path, dst_dir: Path, cfg: QuantConfig, calib: Sequence[Sequence[int]] | None = None) -> QuantResult:
    """Write the engine of `src_dir` quantized as `cfg.mode` into `dst_dir` (model files + engine.json).

    `calib`: token id sequences for int8 / fp8 (each run from an empty KV cache); ignored otherwise.
    """
    from specpipe.engines.base import ENGINE_META, read_engine_meta

    check_kv_cache_dtype(cfg)
    check_calibration(cfg, calib)
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    meta = read_engine_meta(src_dir)
    if meta.get("quant", "none") != "none":
        raise UsageError(f"{src_dir} is already quantized ({meta['quant']}); quantize the unquantized engine")
    if meta.get("kv_layout") == "shared" and cfg.mode not in ("none", "int8-wo", "int4-wo"):
        raise UsageError(f"--quant {cfg.mode} needs optimum's graph (--target-graph optimum); the shared-KV graph of"
                         f" {src_dir} takes weight-only modes (int4-wo, int8-wo)")
    started = time.perf_counter()
    dst_dir.mkdir(parents=True, exist_ok=True)
    untied: list[str] = []
    layers = 0
    if cfg.mode == "none":
        for path in model_files(src_dir):
            shutil.copy2(path, dst_dir / path.name)
    else:
        model = load_model(src_dir)
        untied = untie_lm_head(model)
        layers = len(constant_weight_matmuls(model))
        if cfg.mode in ("int8-wo", "int4-wo"):
            from specpipe.quantize.weight_only import quantize_weight_only

            save_model(quantize_weight_only(model, mode=cfg.mode, group_size=cfg.block_size), dst_dir)
        else:
            from specpipe.quantize.static import quantize_calibrated

            quantize_calibrated(
                model, dst_dir, mode=cfg.mode, calib=calib, window=cfg.calib_window, smooth_quant=cfg.smooth_quant
            )
    meta["quant"] = cfg.mode
    if cfg.mode != "none":
        from specpipe.quantize.static import ORT_OPTIMIZER_SETTINGS

        save_ort_optimized(dst_dir, **ORT_OPTIMIZER_SETTINGS.get(cfg.mode, {}))
        meta["ort_optimized"] = True
    (dst_dir / ENGINE_META).write_text(json.dumps(meta, indent=2) + "\n")
    calib_used = [ids for ids in (calib or []) if ids] if cfg.needs_calibration else []
    weight_only = cfg.mode in ("int8-wo", "int4-wo")
    if weight_only:
        from specpipe.quantize.weight_only import recipe_record
    return QuantResult(
        mode=cfg.mode,
        quantized_layers=layers,
        untied_weights=untied,
        group_size=cfg.block_size if weight_only else None,
        calib_sequences=len(calib_used),
        calib_tokens=sum(len(ids) for ids in calib_used),
        smooth_quant=cfg.smooth_quant and cfg.mode == "int8",
        src_bytes=folder_bytes(src_dir),
        dst_bytes=folder_bytes(dst_dir),
        seconds=round(time.perf_counter() - started, 2),
        recipe=recipe_record(cfg.mode, cfg.block_size) if weight_only else None,
    )


def quantize_with_builder(checkpoint_dir: Path, src_dir: Path, dst_dir: Path, cfg: QuantConfig, *,
                          cancel: Optional[threading.Event] = None) -> QuantResult:
    """Write `checkpoint_dir` as a weight-only engine in `dst_dir` with onnxruntime-genai's model builder
    (weight_only.BUILDER_RECIPES[cfg.mode]); `src_dir` is the unquantized builder engine of the same checkpoint,
    whose engine.json it shares. A source that outputs an EAGLE-3 head's features (engine.json `feature_layers`)
    gives a quantized graph that outputs the same layers. `cancel` stops the builder (run_model_builder)."""
    from specpipe.engines.base import ENGINE_META, read_engine_meta
    from specpipe.export.ortgenai_builder import run_model_builder
    from specpipe.quantize.weight_only import BUILDER_RECIPES

    if cfg.mode not in BUILDER_RECIPES:
        raise UsageError(f"--quant {cfg.mode} on onnxruntime-genai's graph: it takes {', '.join(BUILDER_RECIPES)}")
    recipe = BUILDER_RECIPES[cfg.mode]
    started = time.perf_counter()
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    meta = read_engine_meta(src_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specpipe-builder-", dir=dst_dir.parent) as raw:
        run_model_builder(checkpoint_dir, Path(raw) / "out", recipe.precision, Path(raw) / "cache",
                          extra_options=recipe.options(cfg.block_size), feature_layers=meta.get("feature_layers"),
                          cancel=cancel)
        for path in model_files(Path(raw) / "out"):  # its genai_config.json and tokenizer files are not ours to keep
            shutil.move(str(path), dst_dir / path.name)
    (dst_dir / ENGINE_META).write_text(json.dumps({**meta, "quant": cfg.mode}, indent=2) + "\n")
    return QuantResult(
        mode=cfg.mode, quantized_layers=_count_nodes(dst_dir, "MatMulNBits"), untied_weights=[],
        group_size=cfg.block_size, calib_sequences=0, calib_tokens=0, smooth_quant=False,
        src_bytes=folder_bytes(src_dir), dst_bytes=folder_bytes(dst_dir), seconds=round(time.perf_counter() - started, 2),
        recipe=recipe.as_dict(cfg.block_size),
    )  # fmt: skip


def _count_nodes(folder: Path, op_type: str) -> int:
    import onnx

    graph = onnx.load(str(Path(folder) / model_files(folder)[0].name), load_external_data=False).graph
    return sum(node.op_type == op_type for node in graph.node)


def quantize_engine(
    src_dir: Path,
    dst_dir: Path,
    cfg: QuantConfig,
    tokenizer,
    *,
    model_name: str,
    threads: int = THREADS,
    checkpoint: Path | None = None,
) -> dict:
    """Quantize, measure against `src_dir`, check the budget. Returns the manifest's "quant" block.

    Raises AccuracyBudgetError when over budget, unless cfg.accept_accuracy_loss (then the violations
    are recorded in the block). `model_name` ("target", "draft") names the engine in errors. `checkpoint`:
    the Hugging Face checkpoint of an onnxruntime-genai graph, which its model builder quantizes
    (`quantize_with_builder`); otherwise specpipe quantizes the ONNX graph (`quantize_onnx`).
    The two halves, `quantize_weights` and `judge_quantized`, are also called apart (builder/cpu.py `--quant auto`
    quantizes its candidates side by side and judges each as it is ready).
    """
    result = quantize_weights(src_dir, dst_dir, cfg, tokenizer, checkpoint=checkpoint)
    return judge_quantized(src_dir, dst_dir, result, cfg, tokenizer, model_name=model_name, threads=threads)


def quantize_weights(src_dir: Path, dst_dir: Path, cfg: QuantConfig, tokenizer, *,
                     checkpoint: Path | None = None, cancel: Optional[threading.Event] = None) -> QuantResult:
    """quantize_engine's first half: write `src_dir` quantized as `cfg.mode` into `dst_dir`, nothing measured.
    `cancel` stops the model builder's process (specpipe's own quantizer runs in this one and finishes)."""
    from specpipe.quantize.calibration import calibration_batches

    check_kv_cache_dtype(cfg)
    if cfg.mode == "auto":
        raise UsageError("--quant auto is a build's choice among modes (builder/cpu.py); quantize one mode at a time")
    calib = calibration_batches(tokenizer, cfg) if cfg.needs_calibration else None
    if checkpoint is not None and cfg.mode != "none":
        return quantize_with_builder(checkpoint, src_dir, dst_dir, cfg, cancel=cancel)
    return quantize_onnx(src_dir, dst_dir, cfg, calib)


def judge_quantized(src_dir: Path, dst_dir: Path, result: QuantResult, cfg: QuantConfig, tokenizer, *,
                    model_name: str, threads: int = THREADS) -> dict:
    """quantize_engine's second half: `dst_dir` (made by quantize_weights as `result`) measured against `src_dir`
    and held to the budget. Returns the manifest's "quant" block."""
    from specpipe.quantize.accuracy import check_budget, measure_accuracy
    from specpipe.quantize.calibration import evaluation_batches

    block = {**result.as_dict(), "kv_cache_dtype": cfg.kv_cache_dtype}
    if cfg.mode == "none":
        return block
    report = measure_accuracy(src_dir, dst_dir, evaluation_batches(tokenizer, cfg), threads=threads)
    violations = check_budget(report, cfg.budget, model_name, accept_loss=cfg.accept_accuracy_loss)
    block.update(
        accuracy=report.as_dict(),
        budget=cfg.budget.model_dump(),
        violations=[v.as_dict() for v in violations],
        accepted_over_budget=bool(violations),
    )
    return block
