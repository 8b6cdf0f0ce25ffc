"""`specpipe build`'s config: the pair, its drafts, quantization, the candidate choice, and how the engines
are built (--backend)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from specpipe.config import MAX_SEQ_LEN, NAME_PATTERN, THREADS, THREADS_HELP, Strict, Threads
from specpipe.contract.decoding import DraftSchedule
from specpipe.contract.drafts import SELF_DRAFT_QUANTS, NgramConfig
from specpipe.contract.generation import BenchPromptSet
from specpipe.contract.quant import QuantConfig


class BuildConfig(Strict):
    """`specpipe build`: a draft/target pair -> engines/<name>/ (+ triton_repo/).

    `draft` lists candidates. One is built and deployed as asked. Several are each built and measured
    against the target alone, and the fastest is deployed, or none when no draft beats the target alone
    by `choice.min_speedup` (specpipe/builder/draft_choice.py).
    """

    target: str
    draft: list[str] = Field(
        min_length=1,
        description="candidate drafts: a checkpoint, `ngram`, `self:int4-wo` / `self:int8-wo`, or `none` (the "
        "target alone); a single string is one candidate",
    )
    name: Optional[str] = Field(None, description="default: derived from the pair")
    engines_dir: Path = Path("engines")
    repo_dir: Optional[Path] = Field(Path("triton_repo"), description="Triton model repository to write; None = none")
    max_draft_len: int = Field(8, ge=1, le=64, description="largest K the engines are built for")
    draft_vocab: Optional[int] = Field(
        None, ge=0,
        description="tokens the draft's head scores: the N most frequent in its training data (FR-Spec); "
        "0 = the whole vocabulary; default 8192 when the draft ranks its tokens (specpipe distill writes "
        "draft-vocab.json), else the whole vocabulary",
    )
    triton_instances: int = Field(1, ge=1, description="Triton model instances: requests served in parallel")
    stream_interval: int = Field(
        1, ge=1, description="tokens a streamed response gathers before it is sent (the first goes at once): "
        "fewer responses cost tritonserver and the clients less CPU a token under many streams, at a coarser "
        "stream (TensorRT-LLM's and vLLM's stream_interval; docs/batching.md)")
    force: bool = False
    allow_pickle: bool = False
    backend: "Backend" = Field(
        default_factory=lambda: OnnxRuntimeBackend(),
        description="onnxruntime: CPU engines; tensorrt: TensorRT engines from the ONNX graphs; trtllm: TensorRT-LLM (multi-GPU)",
    )
    ngram: "NgramConfig" = Field(default_factory=lambda: NgramConfig(), description="--draft ngram: lookup sizes")
    choice: "DraftChoiceConfig" = Field(default_factory=lambda: DraftChoiceConfig(),
                                        description="several --draft candidates: how they are measured and chosen")
    quant: "QuantConfig" = Field(default_factory=lambda: QuantConfig(), description="target quantization")
    draft_quant: "QuantConfig" = Field(default_factory=lambda: QuantConfig(), description="draft model quantization")

    @field_validator("name")
    @classmethod
    def _name_is_a_folder_name(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not re.fullmatch(NAME_PATTERN, v):
            raise ValueError(f"{v!r} is not a plain folder name: letters, digits and . _ + - only, at most 128, "
                             "not starting with . + or -")
        return v

    @field_validator("draft", mode="before")
    @classmethod
    def _one_draft_is_a_list_of_one(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("draft")
    @classmethod
    def _candidates_are_valid_and_distinct(cls, v: list[str]) -> list[str]:
        for spec in v:
            if spec.startswith("self:") and spec.removeprefix("self:") not in SELF_DRAFT_QUANTS:
                raise ValueError(
                    f"{spec} is not a self-draft: use " + " or ".join(f"self:{mode}" for mode in SELF_DRAFT_QUANTS)
                    + " (the target's own weight-only quantized engine)"
                )
        repeated = sorted({spec for spec in v if v.count(spec) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} given more than once")
        return v

    @model_validator(mode="after")
    def _auto_quant_is_a_cpu_targets(self) -> "BuildConfig":
        if self.draft_quant.mode == "auto":
            raise ValueError("--draft-quant auto: auto chooses the target's quantization (--quant auto); give the draft a mode")
        if self.quant.mode == "auto" and self.backend.kind != "onnxruntime":
            raise ValueError(f"--quant auto applies to --backend onnxruntime, not {self.backend.kind}")
        return self

    @model_validator(mode="after")
    def _gpu_backends_build_one_draft_model(self) -> "BuildConfig":
        if self.backend.kind != "onnxruntime":
            if len(self.draft) != 1:
                raise ValueError(f"--backend {self.backend.kind} builds one --draft; got {len(self.draft)}")
            if self.draft_vocab is not None:
                raise ValueError("--draft-vocab applies to --backend onnxruntime")
        return self

    @property
    def output_name(self) -> str:
        """The build's folder under engines_dir: --name, else one derived from the pair."""
        return self.name or default_name(self.target, self.draft)

    @property
    def choosing(self) -> bool:
        """Several candidates: measure them all and deploy the fastest (or none)."""
        return len(self.draft) > 1


def default_name(target: str, drafts: list[str]) -> str:
    """TARGET--DRAFT from the last path component of each (TARGET--auto for several candidates: chosen at build)."""

    def short(spec: str) -> str:
        stem = Path(spec.rstrip("/")).name
        stem = stem[:-5] if stem.endswith(".gguf") else stem
        return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.") or "model"

    return f"{short(target)}--{short(drafts[0]) if len(drafts) == 1 else 'auto'}"


class DraftChoiceConfig(Strict):
    """How `build` measures several --draft candidates: greedy, adaptive K with the step costs measured at
    build, on a few packaged bench prompts, every candidate and the target alone interleaved prompt by
    prompt in one run (so load on a shared machine hits all alike); speedup = median tokens/s over the
    target alone's."""

    min_speedup: float = Field(
        1.05, ge=1.0, description="deploy a draft only when it is at least this many times as fast as the target "
        "alone on the sample (a margin over measurement noise); else deploy the target alone",
    )
    choice_sets: list[BenchPromptSet] = Field(
        default_factory=lambda: ["code", "chat"], min_length=1, description="packaged prompt sets of the sample")
    choice_prompts: int = Field(2, ge=1, description="prompts taken from each set (the first N)")
    choice_tokens: int = Field(64, ge=8, description="new tokens per prompt")
    warmup_prompts: int = Field(1, ge=0, description="untimed runs per candidate before measuring")


# ---- `specpipe build --backend`: how the engines are built. Upstream names (trtllm-build flags, quantize.py
# qformats, tensorrtllm_backend parameters) are looked up in specpipe/engines/upstream.py; these fields are
# specpipe's own vocabulary.
class OnnxRuntimeBackend(Strict):
    """CPU engines: exported, optimized for ONNX Runtime, checked against torch and timed on this machine."""

    kind: Literal["onnxruntime"] = "onnxruntime"
    threads: Threads = Field(THREADS, description=THREADS_HELP)
    export_tolerance: float = Field(1e-3, gt=0, description="max |logit diff| engine vs torch (fp32)")
    max_batch_size: int = Field(
        16, ge=1, le=256,
        description="requests decoded together (continuous batching); 1 = one request at a time per instance "
        "(--backend tensorrt/trtllm: 8 unless given)",
    )
    max_queue: int = Field(64, ge=0, description="requests that may wait for a batch slot; beyond that a request is refused at once")
    draft_schedule: Optional[DraftSchedule] = Field(
        None,
        description="batch size -> K table overriding adaptive K under load, e.g. '1:4,4:2,8:1' (up to 1 "
        "request K=4, up to 4 K=2, up to 8 K=1, more: 0 = no speculation); default: chosen per step by goodput",
    )
    target_graph: Literal["auto", "genai", "optimum"] = Field(
        "auto",
        description="target ONNX graph: genai = onnxruntime-genai's model builder (GroupQueryAttention, shared KV "
        "buffer: batches requests); optimum = optimum's export; auto = genai for Llama-family targets, unquantized or "
        "weight-only quantized",
    )


class _GpuBackend(Strict):
    """What both GPU backends plan: everything is decided (and printed with --dry-run) before a GPU step runs."""

    dtype: Literal["float16", "bfloat16"] = Field("float16", description="precision of everything not quantized")
    gpu_memory_gb: Optional[float] = Field(None, gt=0, description="memory of one GPU (GB = 1e9 bytes); checks the plan fits")
    max_batch_size: int = Field(8, ge=1, description="requests scheduled at once (engines and Triton)")
    max_input_len: int = Field(2048, ge=1, description="longest prompt, tokens")
    max_seq_len: Optional[int] = Field(
        None, ge=2, description=f"prompt + output tokens; None = the target's context, at most {MAX_SEQ_LEN}")
    dry_run: bool = Field(False, description="print the plan and write the Triton repository; run no GPU step")


class TensorRTBackend(_GpuBackend):
    """ONNX graphs -> TensorRT engines on one GPU, served by specpipe's own Triton model."""

    kind: Literal["tensorrt"] = "tensorrt"

    # Single-GPU engines, the draft beside the target: tensor parallelism and placement are TensorRT-LLM's options.
    @property
    def tp_size(self) -> int:
        return 1

    @property
    def draft_tp_size(self) -> int:
        return 1

    @property
    def draft_placement(self) -> str:
        return "shared"


class TrtllmBackend(_GpuBackend):
    """TensorRT-LLM, tensor parallel over several GPUs, served by trtllm-serve or its Triton backend."""

    kind: Literal["trtllm"] = "trtllm"
    trtllm_flow: Literal["engine", "llmapi"] = Field(
        "llmapi",
        description="llmapi: TensorRT-LLM >= 1.3's LLM API (PyTorch backend, speculative_config) served by trtllm-serve "
        "or Triton's llmapi model; engine: convert/quantize + trtllm-build + tensorrtllm_backend, pinned to 1.2.1",
    )
    tp_size: int = Field(1, ge=1, description="tensor parallel GPUs for the target")
    draft_tp_size: int = Field(1, ge=1, description="tensor parallel GPUs for the draft")
    draft_placement: Literal["shared", "separate"] = Field(
        "shared", description="shared: the draft runs on the target's first GPU; separate: on its own GPU(s)"
    )
    kv_cache_free_gpu_mem_fraction: Optional[float] = Field(
        None, gt=0, le=1, description="share of free GPU memory for each model's KV cache; None = 0.9, or 0.45 when sharing a GPU"
    )
    calib_size: int = Field(512, ge=1, description="calibration samples for ModelOpt quantization (fp8, int8, int4-wo)")
    trtllm_checkout: Path = Field(
        Path("TensorRT-LLM"), description="checkout of NVIDIA/TensorRT-LLM at the pinned tag (examples/, triton_backend/)"
    )
    modelopt_checkout: Path = Field(
        Path("Model-Optimizer"), description="checkout of NVIDIA/Model-Optimizer (examples/llm_ptq/hf_ptq.py; llmapi flow quantization)"
    )
    draft_len_schedule: Optional[dict[int, int]] = Field(
        None,
        description="llmapi flow: {batch size: draft length} for TensorRT-LLM's in-flight batching (0 = no speculation);"
        " None = K below batch 4, halved at 4 and at each doubling after (specpipe.builder.trtllm.default_draft_len_schedule)",
    )


Backend = Annotated[Union[OnnxRuntimeBackend, TensorRTBackend, TrtllmBackend], Field(discriminator="kind")]


BACKENDS: dict[str, type[Strict]] = {b.model_fields["kind"].default: b for b in (OnnxRuntimeBackend, TensorRTBackend, TrtllmBackend)}


BuildConfig.model_rebuild()  # resolves its fields defined after it (backend, ngram, choice, quant)
