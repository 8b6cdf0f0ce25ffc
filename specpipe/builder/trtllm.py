"""`--backend trtllm`: TensorRT-LLM's steps for a draft/target pair, as plan data.

LLM-API flow (the default; TensorRT-LLM >= 1.3, whose only execution backend is PyTorch; no engine build):

    quantize     ModelOpt PTQ (Model-Optimizer examples/llm_ptq/hf_ptq.py) to a quantized Hugging Face folder,
                 for the modes the PyTorch backend runs (fp8, int4-wo = W4A16 AWQ); nothing else is offered
    serve        `LLM(model, speculative_config=...)`: Draft_Target for a draft model, Eagle3 for an EAGLE-3 head,
                 configured once as typed YAML for trtllm-serve and for Triton's llmapi model (model.yaml)

Engine flow (`--trtllm-flow engine`, TensorRT-LLM 1.2.1, the last stable release with TensorRT engines):

    checkpoint   convert_checkpoint.py (no quantization) or quantize.py (ModelOpt: fp8, int8_sq, int4_awq,
                 int8_wo, and/or an fp8 KV cache), --tp_size fixing the tensor parallel split
    engine       trtllm-build; the target with --speculative_decoding_mode draft_tokens_external and
                 --max_draft_len K; both with paged context FMHA (KV-cache reuse and chunked context need it)
    serve        tensorrtllm_backend: the BLS model runs the draft, then the target on the drafts

Every upstream name used here is in specpipe/engines/upstream.py with the file and commit it was read in.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from specpipe.builder.steps import Step
from specpipe.checkpoint.eagle3 import is_eagle3_architecture, read_eagle3_head
from specpipe.checkpoint.facts import ModelShape
from specpipe.contract.drafts import NgramConfig
from specpipe.engines import upstream

# trtllm-build's own default (gh-pages 1.2.1/commands/trtllm-build.html); raised to max_input_len so a
# whole prompt fits one context step.
DEFAULT_MAX_NUM_TOKENS = 8192


@dataclass(frozen=True)
class ModelJob:
    """One model of the pair and where its artifacts go."""

    role: Literal["target", "draft"]
    spec: str  # what the user named: an alias or a folder
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


class Limits(BaseModel):
    """What the engines are built for (and calibrated on), as the plan settled it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["float16", "bfloat16"]
    max_batch_size: int
    max_input_len: int
    max_seq_len: int  # the target's context, capped, when not given
    max_draft_len: int
    calib_size: Optional[int] = None  # ModelOpt's calibration samples (TensorRT-LLM)


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
    argv = _quantize_argv(job, limits, checkout)
    return Step(
        id=f"{job.role}.quantize", title=f"quantize the {job.role} with ModelOpt ({_quant_label(job)}, tp {job.tp})",
        kind="command", argv=argv, writes=(str(job.checkpoint_dir),), needs=("cuda", "tensorrt_llm", "modelopt", "trtllm-checkout"),
        gpu=True, source=f"NVIDIA/TensorRT-LLM {upstream.TRTLLM_ENGINE_TAG} {upstream.QUANTIZE_SCRIPT}",
    )  # fmt: skip


def _quantize_argv(job: ModelJob, limits: Limits, checkout: Path) -> tuple[str, ...]:
    """quantize.py writing a TensorRT-LLM checkpoint: its default output, so no --export_format (a flag
    1.2.1's quantize_and_export does not take; upstream.QUANTIZE_FLAGS_ENGINE_FLOW)."""
    argv = (
        "python3", str(checkout / upstream.QUANTIZE_SCRIPT), "--model_dir", str(job.hf_dir), "--dtype", limits.dtype,
        "--qformat", qformat(job.quant), "--calib_size", str(limits.calib_size), "--output_dir", str(job.checkpoint_dir),
        "--tp_size", str(job.tp), "--pp_size", "1",
    )  # fmt: skip
    if job.kv_cache_dtype != "auto":
        argv += ("--kv_cache_dtype", job.kv_cache_dtype)
    return argv


def engine_kv_cache_dtype(quant: str, kv_cache_dtype: str) -> str:
    """A model's KV cache dtype on the engine flow: 1.2.1's builder turns paged context FMHA off for an fp8 KV
    cache unless the weights are FP8 / W4A8_AWQ / NVFP4 (upstream.FP8_KV_WEIGHT_QUANT), so such a model keeps
    the model dtype's KV cache instead."""
    if kv_cache_dtype == "fp8" and quant not in upstream.FP8_KV_WEIGHT_QUANT:
        return "auto"
    return kv_cache_dtype


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
        # KV-cache reuse and chunked context (the draft-target loop re-feeds the whole sequence) need paged
        # context FMHA; engine_kv_cache_dtype keeps the builder from turning it off again
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
    """How to start Triton on the GPU machine (printed; specpipe serve runs the CPU repository).

    --multi-model runs each TensorRT-LLM model in its own spawned processes, so several models with
    their own tensor parallel sizes share one server; it requires --world_size 1
    (triton_backend/scripts/launch_triton_server.py @0a2e2c1f).
    """
    script = str(checkout / upstream.LAUNCH_SCRIPT)
    if flow == "llmapi":  # the llmapi model starts its own workers for tensor parallelism
        return ("python3", script, f"--model_repo={repo_dir}")
    return (
        "python3", script, f"--model_repo={repo_dir}", "--multi-model", "--world_size=1",
        "--tensorrt_llm_model_name=tensorrt_llm,tensorrt_llm_draft",
    )  # fmt: skip


# ---- LLM-API flow ----------------------------------------------------------------------------------------


def llmapi_needs_ptq(job: ModelJob) -> bool:
    """The PyTorch backend quantizes the KV cache itself (KvCacheConfig.dtype); weights need ModelOpt PTQ."""
    return job.quant != "none"


def llmapi_quantize_step(job: ModelJob, limits: Limits, modelopt_checkout: Path) -> Optional[Step]:
    """A quantized (unified) Hugging Face folder for the PyTorch backend, from ModelOpt's hf_ptq.py."""
    if not llmapi_needs_ptq(job):
        return None
    argv = (
        "python3", str(modelopt_checkout / upstream.MODELOPT_PTQ_SCRIPT), "--pyt_ckpt_path", str(job.hf_dir),
        "--qformat", upstream.MODELOPT_QFORMAT_FOR_MODE[job.quant],
        "--kv_cache_qformat", upstream.MODELOPT_KV_QFORMAT[job.kv_cache_dtype],
        "--calib_size", str(limits.calib_size), "--export_path", str(job.hf_export_dir),
        "--inference_tensor_parallel", str(job.tp),
    )  # fmt: skip
    return Step(
        id=f"{job.role}.quantize",
        title=f"quantize the {job.role} with ModelOpt ({upstream.MODELOPT_QFORMAT_FOR_MODE[job.quant]}) as a Hugging Face folder",
        kind="command", argv=argv, writes=(str(job.hf_export_dir),), needs=("cuda", "modelopt", "modelopt-checkout"), gpu=True,
        source=f"NVIDIA/Model-Optimizer {upstream.MODELOPT_PTQ_SCRIPT}",
    )  # fmt: skip


def llmapi_model_dir(job: ModelJob) -> Path:
    return job.hf_export_dir if llmapi_needs_ptq(job) else job.hf_dir


def default_draft_len_schedule(max_draft_len: int, max_batch_size: int) -> dict[int, int]:
    """{batch size: draft length}: K below batch 4, then halved at 4 and at each doubling of the batch, down to 0
    (no speculation). Verifying K drafts costs each request K+1 tokens of target compute; while the batch is small
    the GPU is bandwidth-bound and those tokens are nearly free, and once it fills the GPU's compute they crowd out
    other requests' tokens, so fewer drafts pay (specpipe's adaptive K shortens drafts for the same reason)."""
    schedule, batch, draft_len = {1: max_draft_len}, 4, max_draft_len // 2
    while batch <= max_batch_size:
        schedule[batch] = draft_len
        if draft_len == 0:
            break
        batch, draft_len = batch * 2, draft_len // 2
    return schedule


def check_draft_len_schedule(schedule: dict[int, int], max_draft_len: int) -> list[str]:
    """Upstream's own rules (DecodingBaseConfig.validate_draft_len_schedule_and_sort), as one-line problems."""
    problems = []
    if schedule.get(1) != max_draft_len:
        problems.append(f"draft_len_schedule must map batch size 1 to max_draft_len {max_draft_len}")
    problems += [f"draft_len_schedule: batch size {b} must be >= 1" for b in schedule if b < 1]
    problems += [
        f"draft_len_schedule: draft length {n} (batch {b}) must be in 0..{max_draft_len}"
        for b, n in schedule.items() if not 0 <= n <= max_draft_len
    ]  # fmt: skip
    return problems


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DraftTargetSpec(_Strict):
    """DraftTargetDecodingConfig (decoding_type "Draft_Target" at the pin). The two-model DRAFT_TARGET mode is not
    among support_dynamic_draft_len()'s modes, so the batch plan reaches it as max_concurrency only."""

    decoding_type: Literal["Draft_Target"] = upstream.DECODING_TYPES["draft_target"]  # type: ignore[assignment]
    max_draft_len: int = Field(gt=0)
    speculative_model: str
    max_concurrency: Optional[int] = Field(None, ge=0)


class Eagle3Spec(_Strict):
    """Eagle3DecodingConfig for an EAGLE-3 head: one-model EAGLE-3 takes the batch plan as draft_len_schedule, and
    the head's captured layers as eagle3_layers_to_capture (else TensorRT-LLM assumes {1, L/2-1, L-4})."""

    decoding_type: Literal["Eagle3"] = upstream.DECODING_TYPES["eagle3"]  # type: ignore[assignment]
    max_draft_len: int = Field(gt=0)
    speculative_model: str
    eagle3_layers_to_capture: Optional[list[int]] = None
    draft_len_schedule: Optional[dict[int, int]] = None


class NGramSpec(_Strict):
    """NGramDecodingConfig: drafts looked up in the request's own tokens (specpipe's --draft ngram). NGram is not
    among support_dynamic_draft_len()'s modes: the batch plan reaches it as max_concurrency only."""

    decoding_type: Literal["NGram"] = upstream.DECODING_TYPES["ngram"]  # type: ignore[assignment]
    max_draft_len: int = Field(gt=0)
    max_matching_ngram_size: int = Field(gt=0)
    max_concurrency: Optional[int] = Field(None, ge=0)


SpeculativeSpec = Annotated[Union[DraftTargetSpec, Eagle3Spec, NGramSpec], Field(discriminator="decoding_type")]


class KvCacheSpec(_Strict):
    """KvCacheConfig fields (tensorrt_llm.llmapi.KvCacheConfig)."""

    free_gpu_memory_fraction: float = Field(gt=0, le=1)
    enable_block_reuse: bool = True
    dtype: Literal["auto", "fp8"] = "auto"


class TritonSpec(_Strict):
    """model.yaml's triton_config. config.pbtxt carries the same two values (upstream.LAUNCH_DISABLES_AUTO_COMPLETE)."""

    max_batch_size: int = 0  # upstream: "does not support batching"; the LLM batches requests in flight itself
    decoupled: bool = True  # streaming responses


class LlmApiArgs(_Strict):
    """`LLM(**args)` for the PyTorch backend: what trtllm-serve's YAML and Triton's model.yaml both hold."""

    model: str
    backend: Literal["pytorch"] = "pytorch"
    tensor_parallel_size: int = Field(ge=1)
    pipeline_parallel_size: int = 1
    # in-flight batching: requests scheduled together, and the tokens one iteration may carry
    max_batch_size: int = Field(ge=1)
    max_num_tokens: int = Field(ge=1)
    max_seq_len: int = Field(ge=2)
    # a prompt longer than max_num_tokens is prefilled in chunks instead of refused
    enable_chunked_prefill: bool = True
    speculative_config: SpeculativeSpec
    kv_cache_config: KvCacheSpec
    # the two-model draft/target path runs without the overlap scheduler (1.2.1 docs' example)
    disable_overlap_scheduler: Optional[bool] = None

    def to_yaml(self, *, exclude: tuple[str, ...] = ()) -> str:
        import yaml

        # python mode keeps draft_len_schedule's keys integers (json mode would write '1': 8); every value here is
        # a str, int, float, bool or dict of them, which YAML writes as is
        return yaml.safe_dump(self.model_dump(mode="python", exclude_none=True, exclude=set(exclude)), sort_keys=False)


class LlmApiModelYaml(LlmApiArgs):
    """model.yaml of Triton's llmapi model: everything but triton_config goes to LLM(**kwargs)."""

    triton_config: TritonSpec = Field(default_factory=TritonSpec)


def is_eagle3_head(shape: ModelShape) -> bool:
    return is_eagle3_architecture(shape.architecture)


def upstream_draft_len_schedule(schedule: dict[int, int], max_batch_size: int) -> dict[int, int]:
    """specpipe's batch plan ({from batch size b on: draft length}) in the pinned release's reading of
    draft_len_schedule ({up to batch size b: draft length}, 0 above the largest key; upstream.SCHEDULE_MODES).

    Worked example, K = 8, max batch 16: plan {1: 8, 4: 4, 8: 2, 16: 0} -> {1: 8, 3: 8, 7: 4, 15: 2}; batch 2 drafts 8,
    batch 4 drafts 4, batch 16 drafts 0 (above the largest key). Key 1 stays: the validator wants {1: max_draft_len}.
    """
    starts = sorted(schedule)
    out = {1: schedule[starts[0]]}
    for start, end in zip(starts, starts[1:] + [max_batch_size + 1]):
        if schedule[start] > 0 and end - 1 >= start:
            out[end - 1] = schedule[start]
    return dict(sorted(out.items()))


def speculation_off_above(schedule: dict[int, int]) -> Optional[int]:
    """max_concurrency for a mode the schedule cannot reach: the largest batch before the plan drafts 0."""
    off = [batch for batch, draft_len in schedule.items() if draft_len == 0]
    return min(off) - 1 if off else None


def llmapi_args(target: ModelJob, draft: Optional[ModelJob], limits: Limits, kv_fraction: float, schedule: dict[int, int],
                ngram: NgramConfig) -> dict[str, Any]:
    """The LLM(...) arguments both serving paths share. `draft` None: n-gram drafting, up to `ngram.ngram_max` tokens
    matched (the CPU build's --ngram-max)."""
    spec: Any
    off = speculation_off_above(schedule)
    head = read_eagle3_head(draft.spec) if draft is not None else None
    if draft is None:
        spec = NGramSpec(max_draft_len=limits.max_draft_len, max_matching_ngram_size=ngram.ngram_max, max_concurrency=off)
    elif head is not None or is_eagle3_head(draft.shape):
        layers = head.layers_to_capture if head is not None else None
        spec = Eagle3Spec(
            max_draft_len=limits.max_draft_len, speculative_model=str(llmapi_model_dir(draft).absolute()),
            eagle3_layers_to_capture=list(layers) if layers else None,
            draft_len_schedule=upstream_draft_len_schedule(schedule, limits.max_batch_size),
        )  # fmt: skip
    else:  # absolute paths: Triton's working directory is not the build's
        spec = DraftTargetSpec(max_draft_len=limits.max_draft_len, speculative_model=str(llmapi_model_dir(draft).absolute()), max_concurrency=off)
    return dict(
        model=str(llmapi_model_dir(target).absolute()),
        tensor_parallel_size=target.tp,
        max_batch_size=limits.max_batch_size,
        max_num_tokens=max(limits.max_input_len, limits.max_batch_size * (limits.max_draft_len + 1)),
        max_seq_len=limits.max_seq_len,
        speculative_config=spec,
        kv_cache_config=KvCacheSpec(free_gpu_memory_fraction=kv_fraction, dtype=target.kv_cache_dtype),  # type: ignore[arg-type]
        disable_overlap_scheduler=True if isinstance(spec, DraftTargetSpec) else None,
    )


def llmapi_model_yaml(target: ModelJob, draft: Optional[ModelJob], limits: Limits, kv_fraction: float, schedule: dict[int, int],
                      ngram: NgramConfig) -> LlmApiModelYaml:
    return LlmApiModelYaml(**llmapi_args(target, draft, limits, kv_fraction, schedule, ngram))


def trtllm_serve_config(target: ModelJob, draft: Optional[ModelJob], limits: Limits, kv_fraction: float, schedule: dict[int, int],
                        ngram: NgramConfig) -> LlmApiArgs:
    return LlmApiArgs(**llmapi_args(target, draft, limits, kv_fraction, schedule, ngram))


def trtllm_serve_command(model_dir: Path, config_path: Path) -> tuple[str, ...]:
    """trtllm-serve takes the model as its argument; the YAML holds every other LLM argument."""
    return (upstream.TRTLLM_SERVE, str(model_dir.absolute()), upstream.TRTLLM_SERVE_CONFIG_FLAG, str(config_path.absolute()))
