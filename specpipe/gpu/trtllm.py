"""`--backend trtllm`: TensorRT-LLM's steps for a draft/target pair, as plan data.

Engine flow (TensorRT-LLM 1.2.1, the last stable release with TensorRT engines; specpipe/gpu/upstream.py):

    checkpoint   convert_checkpoint.py (no quantization) or quantize.py (ModelOpt: fp8, int8_sq,
                 int4_awq, int8_wo, and/or an fp8 KV cache), --tp_size fixing the tensor parallel split
    engine       trtllm-build; the target with --speculative_decoding_mode draft_tokens_external and
                 --max_draft_len K; both with paged context FMHA (KV-cache reuse needs it)
    serve        tensorrtllm_backend: the BLS model runs the draft, then the target on the drafts

LLM-API flow (the forward path; no engine build): the target and draft Hugging Face folders, optionally
quantized by quantize.py --export_format hf, loaded by `LLM(model, speculative_config=
DraftTargetDecodingConfig(...))` inside Triton's `llmapi` model, configured by a model.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from specpipe.gpu import upstream
from specpipe.gpu.shapes import ModelShape
from specpipe.gpu.steps import Step

# trtllm-build's own default (gh-pages 1.2.1/commands/trtllm-build.html); raised to max_input_len so a
# whole prompt fits one context step without chunking.
DEFAULT_MAX_NUM_TOKENS = 8192


@dataclass(frozen=True)
class ModelJob:
    """One model of the pair and where its artifacts go."""

    role: Literal["target", "draft"]
    shape: ModelShape
    hf_dir: Path  # the resolved Hugging Face folder (a link the resolve step makes)
    quant: str  # specpipe mode: none | fp8 | int8 | int8-wo | int4-wo
    kv_cache_dtype: str  # auto | fp8 | int8
    tp: int
    gpus: tuple[int, ...]
    work_dir: Path  # engines/<name>/trtllm/<role>

    @property
    def checkpoint_dir(self) -> Path:
        return self.work_dir / "checkpoint"

    @property
    def engine_dir(self) -> Path:
        return self.work_dir / "engine"

    @property
    def hf_export_dir(self) -> Path:
        return self.work_dir / "hf_quantized"

    @property
    def engine_files(self) -> list[Path]:
        return [self.engine_dir / upstream.ENGINE_CONFIG_FILE] + [self.engine_dir / upstream.engine_file(r) for r in range(self.tp)]


@dataclass(frozen=True)
class Limits:
    dtype: str  # float16 | bfloat16
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_draft_len: int
    calib_size: int


def needs_modelopt(job: ModelJob) -> bool:
    """quantize.py (ModelOpt) is the path for any quantized weights and for a quantized KV cache."""
    return job.quant != "none" or job.kv_cache_dtype != "auto"


def checkpoint_step(job: ModelJob, limits: Limits, checkout: Path) -> Step:
    """The TensorRT-LLM checkpoint, split `job.tp` ways."""
    if not needs_modelopt(job):
        argv = (
            "python3", str(checkout / upstream.CONVERT_CHECKPOINT_LLAMA),
            "--model_dir", str(job.hf_dir), "--output_dir", str(job.checkpoint_dir),
            "--dtype", limits.dtype, "--tp_size", str(job.tp), "--pp_size", "1",
        )  # fmt: skip
        return Step(
            id=f"{job.role}.checkpoint", title=f"convert the {job.role} to a TensorRT-LLM checkpoint ({limits.dtype}, tp {job.tp})",
            kind="command", argv=argv, writes=(str(job.checkpoint_dir),), needs=("cuda", "tensorrt_llm", "trtllm-checkout"),
            gpu=True, source=f"NVIDIA/TensorRT-LLM {upstream.TRTLLM_ENGINE_TAG} {upstream.CONVERT_CHECKPOINT_LLAMA}",
        )  # fmt: skip
    argv = _quantize_argv(job, limits, checkout, export_format="tensorrt_llm", out=job.checkpoint_dir) + ("--tp_size", str(job.tp), "--pp_size", "1")
    return Step(
        id=f"{job.role}.quantize", title=f"quantize the {job.role} with ModelOpt ({_quant_label(job)}, tp {job.tp})",
        kind="command", argv=argv, writes=(str(job.checkpoint_dir),), needs=("cuda", "tensorrt_llm", "modelopt", "trtllm-checkout"),
        gpu=True, source=f"NVIDIA/TensorRT-LLM {upstream.TRTLLM_ENGINE_TAG} {upstream.QUANTIZE_SCRIPT}",
    )  # fmt: skip


def _quantize_argv(job: ModelJob, limits: Limits, checkout: Path, *, export_format: str, out: Path) -> tuple[str, ...]:
    argv = (
        "python3", str(checkout / upstream.QUANTIZE_SCRIPT), "--model_dir", str(job.hf_dir), "--dtype", limits.dtype,
        "--qformat", qformat(job.quant), "--calib_size", str(limits.calib_size), "--output_dir", str(out),
        "--export_format", export_format,
    )  # fmt: skip
    if job.kv_cache_dtype != "auto":
        argv += ("--kv_cache_dtype", job.kv_cache_dtype)
    return argv


def qformat(quant: str) -> str:
    """quantize.py --qformat for a specpipe mode; full_prec quantizes nothing but the KV cache."""
    return "full_prec" if quant == "none" else upstream.QFORMAT_FOR_MODE[quant]


def _quant_label(job: ModelJob) -> str:
    kv = "" if job.kv_cache_dtype == "auto" else f", {job.kv_cache_dtype} KV cache"
    return f"{qformat(job.quant)}{kv}"


def build_step(job: ModelJob, limits: Limits) -> Step:
    argv = [
        upstream.TRTLLM_BUILD,
        "--checkpoint_dir", str(job.checkpoint_dir), "--output_dir", str(job.engine_dir),
        "--gemm_plugin", "auto",
        # KV-cache reuse (the draft-target loop re-feeds accepted tokens) needs paged context FMHA
        "--use_paged_context_fmha", "enable",
        "--max_batch_size", str(limits.max_batch_size), "--max_input_len", str(limits.max_input_len),
        "--max_seq_len", str(limits.max_seq_len), "--max_num_tokens", str(max(DEFAULT_MAX_NUM_TOKENS, limits.max_input_len)),
        # draft logits (draft) and target logits (target) let the BLS accept by p/q (use_draft_logits)
        "--gather_generation_logits",
        "--workers", str(job.tp),
    ]  # fmt: skip
    if job.role == "target":
        argv += ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(limits.max_draft_len)]
    return Step(
        id=f"{job.role}.engine", title=f"build the {job.role} engine ({job.tp} rank{'s' if job.tp > 1 else ''})",
        kind="command", argv=tuple(argv), writes=tuple(str(p) for p in job.engine_files),
        needs=("cuda", "tensorrt_llm", "trtllm-build"), gpu=True,
        source=f"NVIDIA/TensorRT-LLM gh-pages {upstream.TRTLLM_ENGINE_VERSION}/commands/trtllm-build.html; examples/draft_target_model/README.md",
    )  # fmt: skip


def engine_flow_steps(jobs: list[ModelJob], limits: Limits, checkout: Path) -> list[Step]:
    steps: list[Step] = []
    for job in jobs:
        steps += [checkpoint_step(job, limits, checkout), build_step(job, limits)]
    return steps


def serve_command(repo_dir: Path, checkout: Path, flow: str) -> tuple[str, ...]:
    """How to start the server on the GPU machine (printed; specpipe serve runs the CPU repository).

    --multi-model runs each TensorRT-LLM model in its own spawned processes, so several models with
    their own tensor parallel sizes share one server; it requires --world_size 1
    (triton_backend/scripts/launch_triton_server.py @0a2e2c1f).
    """
    script = str(checkout / "triton_backend/scripts/launch_triton_server.py")
    if flow == "llmapi":  # tensorrtllm_backend docs/llmapi.md ("Launch server")
        return ("python3", script, f"--model_repo={repo_dir}")
    return (
        "python3", script, f"--model_repo={repo_dir}", "--multi-model", "--world_size=1",
        "--tensorrt_llm_model_name=tensorrt_llm,tensorrt_llm_draft",
    )  # fmt: skip


# ---- LLM-API flow ----------------------------------------------------------------------------------------


def llmapi_quantize_step(job: ModelJob, limits: Limits, checkout: Path) -> Optional[Step]:
    """A quantized Hugging Face folder for the PyTorch backend (quantize.py --export_format hf)."""
    if not needs_modelopt(job):
        return None
    return Step(
        id=f"{job.role}.quantize", title=f"quantize the {job.role} with ModelOpt ({_quant_label(job)}) as a Hugging Face folder",
        kind="command", argv=_quantize_argv(job, limits, checkout, export_format="hf", out=job.hf_export_dir),
        writes=(str(job.hf_export_dir),), needs=("cuda", "tensorrt_llm", "modelopt", "trtllm-checkout"), gpu=True,
        source=f"NVIDIA/TensorRT-LLM {upstream.TRTLLM_ENGINE_TAG} {upstream.QUANTIZE_SCRIPT} (--export_format hf)",
    )  # fmt: skip


def llmapi_model_dir(job: ModelJob) -> Path:
    return job.hf_export_dir if needs_modelopt(job) else job.hf_dir


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DraftTargetSpec(_Strict):
    """`speculative_config` as DecodingBaseConfig.from_dict reads it (1.2.1 llm_args.py)."""

    decoding_type: Literal["DraftTarget"] = upstream.LLMAPI_DRAFT_TARGET_TYPE
    max_draft_len: int = Field(gt=0)
    speculative_model: str


class KvCacheSpec(_Strict):
    """KvCacheConfig fields (tensorrt_llm.llmapi.KvCacheConfig)."""

    free_gpu_memory_fraction: float = Field(gt=0, le=1)
    enable_block_reuse: bool = True
    dtype: Literal["auto", "fp8"] = "auto"


class TritonSpec(_Strict):
    """model.yaml's triton_config: read by the llmapi model.py's auto_complete_config."""

    max_batch_size: int = 0  # upstream: "does not support batching"; requests still run concurrently
    decoupled: bool = True  # streaming responses


class LlmApiModelYaml(_Strict):
    """model.yaml of Triton's llmapi model: everything but triton_config goes to LLM(**kwargs)."""

    model: str
    backend: Literal["pytorch"] = "pytorch"
    tensor_parallel_size: int = Field(ge=1)
    pipeline_parallel_size: int = 1
    speculative_config: DraftTargetSpec
    kv_cache_config: KvCacheSpec
    # the two-model draft/target path runs without the overlap scheduler (1.2.1 docs' example)
    disable_overlap_scheduler: bool = True
    triton_config: TritonSpec = Field(default_factory=TritonSpec)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def llmapi_model_yaml(target: ModelJob, draft: ModelJob, limits: Limits, kv_fraction: float) -> LlmApiModelYaml:
    kv_dtype: Any = "fp8" if target.kv_cache_dtype == "fp8" else "auto"
    return LlmApiModelYaml(
        model=str(llmapi_model_dir(target).absolute()),  # Triton's working directory is not the build's
        tensor_parallel_size=target.tp,
        speculative_config=DraftTargetSpec(max_draft_len=limits.max_draft_len, speculative_model=str(llmapi_model_dir(draft).absolute())),
        kv_cache_config=KvCacheSpec(free_gpu_memory_fraction=kv_fraction, dtype=kv_dtype),
    )
