"""One strict, typed config tree. Every default lives here; the CLI reads its defaults from these models."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal, Optional, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


BenchPromptSet = Literal["code", "chat", "grounded"]  # the packaged prompt sets (specpipe/bench/prompts)
# The engines `bench --peer` can run beside specpipe's own (specpipe/bench/peers): transformers, OpenVINO GenAI,
# onnxruntime-genai, llama.cpp (llama-cpp-python). All but hf come from the `peers` extra.
PeerName = Literal["hf", "openvino", "ortgenai", "llamacpp"]

# Intra-op threads of ONNX Runtime (and torch) wherever none are given: the README's measurements use 2.
THREADS = 2
# The most any command takes: past a few per CPU, threads only wait on each other (--threads 100000 hung
# ONNX Runtime's session start for minutes before anything was printed).
MAX_THREADS = 4 * (os.cpu_count() or 1)
THREADS_HELP = f"ONNX Runtime intra-op threads (1 to {MAX_THREADS}: 4 per CPU of this machine)"


def _threads_fit_this_machine(threads: int) -> int:
    if threads > MAX_THREADS:
        raise ValueError(f"{threads} is more than {MAX_THREADS} (4 per CPU of this machine): more only wait on each other")
    return threads


Threads = Annotated[int, Field(ge=1), AfterValidator(_threads_fit_this_machine)]
# A build's folder name (--name): it becomes a path and a word in commands people paste into a shell.
NAME_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,127}"
# The longest sequence an engine is built for when the model's context is longer (or --max-seq-len not given).
MAX_SEQ_LEN = 8192


class SamplingConfig(Strict):
    """How a next-token distribution is shaped. Applied identically to target (p) and draft (q).

    temperature == 0 means greedy (argmax); top_k == 0 and top_p == 1.0 mean "off".
    """

    temperature: float = Field(0.0, ge=0.0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = off")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass to keep, in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class GenerationConfig(Strict):
    """One request: sampling, lengths, stopping, speculation."""

    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    max_new_tokens: int = Field(128, ge=1)
    num_draft_tokens: int = Field(4, ge=1, description="K: tokens the draft proposes per step (the first K when adaptive)")
    draft_length: Literal["adaptive", "heuristic", "fixed"] = Field(
        "adaptive",
        description="adaptive: each step drafts the K of highest expected speedup for this request's acceptance "
        "and the engines' measured costs, and a model draft stops when unsure; heuristic: transformers' "
        "+2/-1 schedule; fixed: always num_draft_tokens",
    )
    max_draft_tokens: int = Field(16, ge=1, description="adaptive K's ceiling (also capped by the build's max_draft_len)")
    min_draft_confidence: float = Field(
        0.4, ge=0.0, le=1.0, description="adaptive and heuristic: stop drafting after a token whose top draft probability is below this"
    )
    speculative: bool = True
    stop: list[str] = Field(default_factory=list, description="stop strings (checked on decoded text)")
    stop_on_eos: bool = True
    seed: Optional[int] = Field(None, ge=0, description="seed for sampling; None = nondeterministic")

    @model_validator(mode="after")
    def _adaptive_k_fits(self) -> "GenerationConfig":
        if self.draft_length != "fixed" and self.num_draft_tokens > self.max_draft_tokens:
            raise ValueError(
                f"num_draft_tokens {self.num_draft_tokens} > max_draft_tokens {self.max_draft_tokens} (adaptive K starts there)"
            )
        return self


class RuntimeConfig(Strict):
    """How a deployment's engines run in this process (`generate ENGINE_DIR`, `validate`'s in-process engines)."""

    threads: Threads = Field(THREADS, description=THREADS_HELP)


class BuildConfig(Strict):
    """`specpipe build`: a draft/target pair -> engines/<name>/ (+ triton_repo/).

    `draft` lists candidates. One is built and deployed as asked. Several are each built and measured
    against the target alone, and the fastest is deployed, or none when no draft beats the target alone
    by `choice.min_speedup` (specpipe/build/draft_choice.py).
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


DraftKind = Literal["model", "ngram", "self", "none"]


def draft_kind(spec: str) -> DraftKind:
    """What a --draft value names: prompt lookup, the target quantized, no draft, or a checkpoint."""
    if spec in ("ngram", "none"):
        return spec
    return "self" if spec.startswith("self:") else "model"


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


# ---- `specpipe validate`: the gate file (TOML). Every section and key is optional; a missing latency
# threshold means "report only". The README's "Validation gate" section documents these keys.

_GATE_PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Explain what a hash table is in two sentences.",
    "import numpy as np\n\n",
    "Once upon a time, in a small village,",
    "Write a Python function that reverses a string.",
]
_GATE_CONTEXTS = ["The capital of France is", "import numpy as"]  # uncertain next token, not flat


class GateGreedyConfig(Strict):
    """Greedy equivalence: speculative token ids == target-only token ids, prompt by prompt."""

    enabled: bool = True
    max_new_tokens: int = Field(32, ge=1)
    near_tie_margin: Optional[float] = Field(
        None, ge=0,
        description="a first mismatch where the target's top-2 logit margin is within this is a warning, not a failure;"
        " None = the tolerance of the target's precision (speculative/equivalence.py)",
    )


class GateDistributionConfig(Strict):
    """Distribution equivalence: the first two emitted tokens follow the target's exact p (chi-square)."""

    enabled: bool = True
    contexts: list[str] = Field(default_factory=lambda: list(_GATE_CONTEXTS), min_length=1)
    temperatures: list[float] = Field(default_factory=lambda: [1.0, 0.7], min_length=1)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    draft_lengths: list[int] = Field(
        default_factory=lambda: [1, 2], min_length=1,
        description="K per sample, round robin: K=1 puts the bonus token at position 2, K=2 a second draft",
    )
    tv: float = Field(0.05, gt=0.0, lt=1.0, description="total-variation error the test must detect")
    alpha: float = Field(1e-3, gt=0.0, lt=1.0, description="family-wise false-alarm rate (Bonferroni over all tests)")
    power: float = Field(0.99, gt=0.0, lt=1.0, description="probability of detecting an error of size tv")
    min_expected: float = Field(5.0, gt=0.0, description="bins expecting fewer samples are pooled")
    max_bins: int = Field(32, ge=2, description="most effective bins per test (likeliest tokens; the rest pooled)")
    max_samples: int = Field(20000, ge=10, description="cap on in-process samples per (context, temperature)")
    server_samples: int = Field(1500, ge=10, description="samples per (context, temperature) through a server")
    planted_replicates: int = Field(200, ge=1, description="replicates of the planted wrong sampler")
    planted_power_min: float = Field(0.9, gt=0.0, le=1.0, description="share of planted replicates that must fail")
    seed: int = 0

    @field_validator("temperatures")
    @classmethod
    def _positive_temperatures(cls, v: list[float]) -> list[float]:
        if any(t <= 0 for t in v):
            raise ValueError("temperatures must be > 0 (greedy decoding is the greedy check's job)")
        return v

    @field_validator("draft_lengths")
    @classmethod
    def _positive_draft_lengths(cls, v: list[int]) -> list[int]:
        if any(k < 1 for k in v):
            raise ValueError("draft_lengths must be >= 1")
        return v


class GateQuantizationConfig(Strict):
    """Quantization accuracy (keys as in AccuracyBudget). A budget left out is the one the build recorded."""

    enabled: bool = True
    max_ppl_increase: Optional[float] = Field(None, ge=0.0, description="relative perplexity increase, 0.05 = +5%")
    min_top1_agreement: Optional[float] = Field(None, ge=0.0, le=1.0)
    max_mean_kl: Optional[float] = Field(None, gt=0.0, description="mean KL(unquantized || quantized), nats")


class GateLatencyConfig(Strict):
    """Latency and speed SLOs. Each threshold left out (None) is reported, not enforced."""

    enabled: bool = True
    concurrency: int = Field(2, ge=1, description="users in flight at once: the concurrency the SLO holds at")
    requests: int = Field(8, ge=1, description="measured requests per configuration (speculative, target-only)")
    warmup_requests: int = Field(2, ge=0, description="requests run first and not measured")
    max_new_tokens: int = Field(64, ge=2)
    ttft_ms_p50_max: Optional[float] = Field(None, gt=0.0)
    ttft_ms_p95_max: Optional[float] = Field(None, gt=0.0)
    itl_ms_p50_max: Optional[float] = Field(None, gt=0.0)
    itl_ms_p95_max: Optional[float] = Field(None, gt=0.0)
    tokens_per_s_min: Optional[float] = Field(None, gt=0.0)
    speedup_min: Optional[float] = Field(None, gt=0.0)
    acceptance_rate_min: Optional[float] = Field(None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _every_user_sends(self) -> "GateLatencyConfig":
        # Through a server the runs are specpipe.bench.load levels: fewer requests than users is a lower concurrency.
        if self.requests < self.concurrency:
            raise ValueError(f"requests {self.requests} < concurrency {self.concurrency}: the SLO would be measured at a lower load")
        return self


class GateRobustnessConfig(Strict):
    """Bad requests are refused with clear errors and the server still answers (server modes only)."""

    enabled: bool = True


class GateConfig(Strict):
    """A gate file: `specpipe validate --gate FILE`. GateConfig() is the default gate."""

    prompts: list[str] = Field(default_factory=lambda: list(_GATE_PROMPTS), min_length=1,
                               description="prompts of the greedy and latency checks")
    chat: bool = Field(False, description="apply the tokenizer's chat template to prompts and contexts")
    num_draft_tokens: int = Field(4, ge=1, description="K of the greedy and latency checks")
    greedy: GateGreedyConfig = Field(default_factory=GateGreedyConfig)
    distribution: GateDistributionConfig = Field(default_factory=GateDistributionConfig)
    quantization: GateQuantizationConfig = Field(default_factory=GateQuantizationConfig)
    latency: GateLatencyConfig = Field(default_factory=GateLatencyConfig)
    robustness: GateRobustnessConfig = Field(default_factory=GateRobustnessConfig)


DistillData = Literal["answers", "stdlib"]


DistillDtype = Literal["auto", "float32", "bfloat16", "float16"]

# Training settings whose best value differs by --kind; a DistillConfig field left unset takes its kind's value.
# eagle3: a ~10M-weight head learns most per token with small batches and a higher rate (docs/eagle3.md measures it).
DISTILL_KIND_DEFAULTS: dict[str, dict[str, float]] = {
    "model": {"lr": 1e-3, "batch_tokens": 4096},
    "eagle3": {"lr": 3e-3, "batch_tokens": 1024},
}


class DistillConfig(Strict):
    """`specpipe distill`: train a small draft for a target on CPU, toward the target's next-token distribution.

    The time budget covers both phases: generating the target's answers to training prompts (a share
    `data_fraction`, skipped when cached answers already used it) and training on them.
    """

    target: str
    out: Path
    layers: int = Field(2, ge=1, le=64, description="decoder layers of the draft (evenly spaced target layers to start)")
    width: int = Field(
        0, ge=0, description="hidden size of the draft; 0 = the target's: embedding, head and layers start as the "
        "target's (narrower: projected onto the target's principal directions)"
    )
    minutes: float = Field(
        12.0, gt=0, description="time budget in minutes: target answers + training; with --answer-tokens/--train-tokens "
        "a cap on each phase (its share of the minutes), not the budget"
    )
    answer_tokens: Optional[int] = Field(
        None, ge=1, description="work budget: generate target answers until they hold this many tokens (the same data "
        "on any machine; default: as many as --minutes allows)"
    )
    train_tokens: Optional[int] = Field(
        None, ge=1, description="work budget: train on this many tokens (the same training on any machine; default: "
        "as many as --minutes allows)"
    )
    data_fraction: float = Field(0.6, ge=0.0, lt=1.0, description="share of --minutes for generating target answers")
    seed: int = 0
    data: list[DistillData] = Field(
        default_factory=lambda: ["answers"], min_length=1,
        description="answers: the target's own answers to training prompts; stdlib: Python standard library source",
    )
    prompts: Optional[Path] = Field(None, description='extra training prompts, JSONL lines with {"prompt": ...}')
    max_answer_tokens: int = Field(160, ge=8, description="longest target answer generated for training")
    answer_batch: int = Field(48, ge=1, description="prompts the target answers at once")
    sample_temperature: float = Field(0.7, gt=0.0, description="temperature of answers after the greedy first pass")
    teacher_top_k: int = Field(32, ge=1, description="target probabilities kept per position")
    teacher_dtype: DistillDtype = Field(
        "auto", description="precision the target answers in; auto: time each on this machine for a second, keep the faster"
    )
    train_dtype: DistillDtype = Field(
        "auto", description="precision of the draft's training matmuls (autocast; weights stay fp32); auto: measured as above"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the target answers and the draft trains; "
                                                   "auto: CUDA when torch sees a GPU")
    lr: Optional[float] = Field(None, gt=0.0, description="peak learning rate (AdamW, cosine over the budget); default "
                                "by --kind: model 1e-3, eagle3 3e-3")
    batch_tokens: Optional[int] = Field(None, ge=64, description="tokens per training step; default by --kind: model "
                                        "4096, eagle3 1024")
    negatives: int = Field(2048, ge=0, description="random vocabulary entries scored with the teacher's top-k each step")
    checkpoint_every: int = Field(50, ge=1, description="steps between saved training states (for --resume)")
    resume: bool = Field(False, description="continue a stopped run from OUT's saved training state")
    force: bool = Field(False, description="replace an existing OUT")
    threads: Threads = Field(THREADS, description="torch threads")
    # ---- --kind: what is trained (specpipe/distill/eagle3.py for eagle3) ----
    kind: Literal["model", "eagle3"] = Field(
        "model", description="model: a small Llama draft (its own layers and embedding); eagle3: an EAGLE-3 head that "
        "reads the target's hidden states (written in upstream's EAGLE-3 checkpoint format)"
    )
    feature_layers: Optional[list[int]] = Field(
        None, description="eagle3: target layers whose outputs the head reads (0-based layer-output ids, SGLang / "
        "TensorRT-LLM numbering); default 1, N/2-1, N-4"
    )
    head_vocab: int = Field(8192, ge=16, description="eagle3: draft vocabulary of the head (the most frequent answer tokens)")
    ttt_steps: int = Field(3, ge=1, le=16, description="eagle3: training-time test, steps the head is unrolled on its own states")
    ttt_decay: float = Field(0.8, gt=0.0, le=1.0, description="eagle3: loss weight of unrolled step k is decay^k (normalized)")
    warm_start: bool = Field(True, description="eagle3: start lm_head rows, final norm and MLP from the target's")

    @model_validator(mode="before")
    @classmethod
    def _kind_defaults(cls, values):
        if isinstance(values, dict):
            unset = {name: value for name, value in DISTILL_KIND_DEFAULTS.get(values.get("kind", "model"), {}).items()
                     if values.get(name) is None}
            values = {**values, **unset}
        return values


class BenchConfig(Strict):
    """`specpipe bench`: target-only, speculative K=1..8 (and adaptive K), and the peers (transformers,
    OpenVINO GenAI, onnxruntime-genai, llama.cpp) on the same pair, prompts and settings, in one run."""

    engine_dir: Path
    prompts: list[Path] = Field(default_factory=list, description="JSONL prompt files ({\"prompt\": ...} per line)")
    prompt_sets: list[BenchPromptSet] = Field(
        default_factory=list, description="packaged prompt sets; code and chat when neither these nor --prompts are given"
    )
    draft_lengths: list[int] = Field(default_factory=lambda: list(range(1, 9)), min_length=1,
                                     description="fixed K values to run")
    adaptive: bool = Field(True, description="also run the default adaptive draft length")
    peers: list[PeerName] = Field(
        default_factory=lambda: ["hf"],
        description="other engines to run on the same pair, prompts and settings: hf, openvino, ortgenai, llamacpp",
    )
    peer_draft_lengths: Optional[list[int]] = Field(
        None, description="fixed K values for the peers' draft-model rows (default: the -k values)"
    )
    max_new_tokens: int = Field(128, ge=1)
    threads: Threads = Field(THREADS, description="threads of every engine: ONNX Runtime intra-op, torch, and each peer's own")
    chat: bool = Field(True, description="apply the tokenizer's chat template to each prompt")
    max_prompts: Optional[int] = Field(None, ge=1, description="use only the first N prompts of each set")
    warmup_prompts: int = Field(1, ge=0, description="untimed runs per row before measuring")

    @field_validator("draft_lengths", "peer_draft_lengths")
    @classmethod
    def _positive_draft_lengths(cls, v: Optional[list[int]]) -> Optional[list[int]]:
        if v is None:
            return v
        if any(k < 1 for k in v):
            raise ValueError(f"K must be >= 1, got {sorted(v)}")
        return sorted(set(v))

    @field_validator("peers")
    @classmethod
    def _unique_peers(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))


class LoadConfig(Strict):
    """`specpipe loadtest`: closed-loop streaming users against a Triton server, one level per concurrency.

    Requests carry tensorrtllm_backend's tensor names only, so the server decodes with its deployment's own
    settings (greedy, its draft length) unless num_draft_tokens is given."""

    concurrency: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16], min_length=1,
                                   description="users (streams in flight) per level")
    requests: int = Field(32, ge=1, description="measured requests per level")
    requests_per_user: int = Field(0, ge=0, description="at least this many requests per user at each level "
                                                        "(a level runs max(requests, this x users))")
    warmup_requests: int = Field(2, ge=0, description="requests sent first, one at a time, and not measured")
    max_tokens: int = Field(64, ge=1, description="new tokens per request")
    prompt_set: BenchPromptSet = Field("code", description="packaged prompt set the requests cycle through")
    prompts: Optional[Path] = Field(None, description='JSONL prompt file ({"prompt": ...} per line) instead of the set')
    num_draft_tokens: Optional[int] = Field(
        None, ge=0, description="K sent with every request (0 = target only); default: the deployment's own"
    )
    ignore_eos: bool = Field(True, description="generate max_tokens even past EOS (TensorRT-LLM's end_id -1): "
                                               "every row does the same work")
    request_timeout_s: float = Field(600.0, gt=0, description="longest wait for the next response of a request")
    rss_interval_s: float = Field(0.5, gt=0, description="seconds between samples of the server's memory")
    label: Optional[str] = Field(None, description="row name in tables and plots; default: the target's name")
    arrivals: Literal["staggered", "burst"] = Field(
        "staggered", description="staggered: user n starts n/C of a request's latency (the warm-up's) after the "
                                 "level begins, as independent users do; burst: every user at once (equal-length "
                                 "requests then stay in step: every user's next prompt arrives in the same step)")
    against_target_only: bool = Field(
        False, description="run every level twice on the same server, once with K = 0 sent in every request "
                           "(the target alone, batched) and once as deployed, each in two halves in the order "
                           "A B B A so that drift favours neither: two runs, '<label> target-only' and '<label>'")

    @field_validator("concurrency")
    @classmethod
    def _positive_levels(cls, v: list[int]) -> list[int]:
        if any(c < 1 for c in v):
            raise ValueError(f"every level needs >= 1 user, got {v}")
        return sorted(set(v))

    @model_validator(mode="after")
    def _every_user_sends(self) -> "LoadConfig":
        if max(self.requests, self.requests_per_user * max(self.concurrency)) < max(self.concurrency):
            raise ValueError(f"requests {self.requests} < concurrency {max(self.concurrency)}: some users would send nothing")
        if self.against_target_only and self.num_draft_tokens is not None:
            raise ValueError("against_target_only sends K = 0 and the deployment's own K: num_draft_tokens would "
                             "override the second")
        return self

    def requests_at(self, concurrency: int) -> int:
        return max(self.requests, self.requests_per_user * concurrency)


def make_config(model: type[BaseModel], **values):
    """Build a config model; a validation failure becomes one UsageError line naming the CLI option."""
    from pydantic import ValidationError

    from specpipe.errors import UsageError

    try:
        return model(**values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            names = [part for part in err["loc"] if isinstance(part, str)]
            if names[:1] == ["backend"] and len(names) > 2:  # backend, its kind, the field: the option is the field's
                if err["type"] == "extra_forbidden":
                    problems.append(f"--{names[2].replace('_', '-')} does not apply to --backend {names[1]}")
                    continue
                names = names[2:]
            message = err["msg"].removeprefix("Value error, ")
            problems.append(f"--{'-'.join(names).replace('_', '-')}: {message}" if names else message)
        raise UsageError("; ".join(problems)) from None


def field_default(model: type[BaseModel], name: str):
    """The default of a config field, for click options (so help text and behaviour cannot drift)."""
    return model.model_fields[name].get_default(call_default_factory=True)


def field_help(model: type[BaseModel], name: str) -> str:
    return model.model_fields[name].description or ""


def field_choices(model: type[BaseModel], name: str) -> list[str]:
    """The values of a Literal field (or of a list or Optional of one), for click.Choice."""
    annotation = model.model_fields[name].annotation
    while get_origin(annotation) is not Literal:
        annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
    return list(get_args(annotation))


# `--draft self:MODE`: weight-only modes only. A self-draft must be much cheaper than the target, and these
# are the fast CPU path (MatMulNBits) that needs no calibration data.
SELF_DRAFT_QUANTS = ("int4-wo", "int8-wo")


class NgramConfig(Strict):
    """Prompt lookup drafting: match the context's last n tokens, n from ngram_max down to ngram_min.

    Peers: transformers matches n <= 2 (`max_matching_ngram_size`), vLLM asks for `prompt_lookup_max`
    with `prompt_lookup_min` defaulting to 1.
    """

    ngram_max: int = Field(3, ge=1, description="longest n-gram to look up")
    ngram_min: int = Field(1, ge=1, description="shortest n-gram to look up")

    @model_validator(mode="after")
    def _min_le_max(self) -> "NgramConfig":
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min {self.ngram_min} > ngram_max {self.ngram_max}")
        return self




QuantMode = Literal["none", "int8-wo", "int4-wo", "int8", "fp8"]  # how an engine is quantized
# --quant may also be `auto`: the build quantizes the target as each of AUTO_QUANT_CANDIDATES in turn and
# keeps the first within its accuracy budget, else the unquantized engine (build/cpu.py `_auto_quant`).
QuantChoice = Literal["none", "int8-wo", "int4-wo", "int8", "fp8", "auto"]
AUTO_QUANT_CANDIDATES = ("int4-wo", "int8-wo")  # fastest first on CPU (MatMulNBits reads 4, then 8 bits a weight)
KvCacheDtype = Literal["auto", "fp8", "int8"]


class AccuracyBudget(Strict):
    """How far a quantized engine may drift from the unquantized engine of the same model.

    Measured teacher-forced on held-out text and prompts disjoint from the calibration set
    (specpipe.quantize.accuracy). Relative perplexity change = ppl_quant / ppl_ref - 1.
    """

    max_ppl_increase: float = Field(0.05, ge=0.0, description="largest relative perplexity increase (0.05 = +5%)")
    min_top1_agreement: float = Field(0.9, ge=0.0, le=1.0, description="smallest share of positions whose argmax matches")
    max_mean_kl: Optional[float] = Field(None, gt=0.0, description="largest mean KL(p_ref || p_quant) in nats; None = report only")


class QuantConfig(Strict):
    """How one engine (target or draft) is quantized; `mode` none keeps fp32.

    int8-wo / int4-wo: weight-only, ONNX Runtime MatMulNBits, group-wise. On the model builder's graph the
    builder quantizes (specpipe.quantize.weight_only.BUILDER_RECIPES: int4 k-quant with the lm_head and the
    sensitive layers at int8); on optimum's graph specpipe does (RECIPES: int4 asymmetric, lm_head at int8).
    int8: W8A8 QDQ, per-channel weights, per-tensor activation scales calibrated on prompts.
    fp8: E4M3 weights and activations as QDQ with calibrated scales; ONNX Runtime on CPU emulates
    it (that is how accuracy is checked here), TensorRT on Hopper/Ada runs the same graph natively.
    auto (a CPU target only): the first of AUTO_QUANT_CANDIDATES within the budget, else none.
    """

    mode: QuantChoice = "none"
    group_size: int = Field(32, ge=16, description="weight-only: weights per quantization group (power of 2, >= 16)")
    calib_prompts: Optional[Path] = Field(None, description="JSONL with {\"prompt\": ...} lines; None = the packaged set")
    calib_size: int = Field(64, ge=1, description="calibration prompts used for int8 / fp8")
    calib_window: int = Field(128, ge=8, description="tokens per calibration run (prompts are packed into windows)")
    smooth_quant: bool = Field(False, description="int8: SmoothQuant smoothing before quantizing (needs neural-compressor)")
    kv_cache_dtype: KvCacheDtype = Field("auto", description="KV cache precision; fp8/int8 need an engine that stores it so")
    budget: AccuracyBudget = Field(default_factory=AccuracyBudget)
    accept_accuracy_loss: bool = Field(False, description="keep an engine that is over its accuracy budget")

    @field_validator("group_size")
    @classmethod
    def _group_size_is_a_power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"group size must be a power of 2 (MatMulNBits block size), got {v}")
        return v

    @property
    def needs_calibration(self) -> bool:
        return self.mode in ("int8", "fp8")


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
    draft_schedule: Optional[str] = Field(
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

    @field_validator("draft_schedule")
    @classmethod
    def _schedule_parses(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            parse_draft_schedule(v)
        return v


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
        " None = K below batch 4, halved at 4 and at each doubling after (specpipe.build.trtllm.default_draft_len_schedule)",
    )


Backend = Annotated[Union[OnnxRuntimeBackend, TensorRTBackend, TrtllmBackend], Field(discriminator="kind")]
BACKENDS: dict[str, type[Strict]] = {b.model_fields["kind"].default: b for b in (OnnxRuntimeBackend, TensorRTBackend, TrtllmBackend)}

BuildConfig.model_rebuild()  # resolves its fields defined after it (backend, ngram, choice, quant)


def parse_draft_schedule(text: str) -> list[tuple[int, int]]:
    """'1:4,4:2,8:0' -> [(1, 4), (4, 2), (8, 0)]: batch sizes up to the bound draft K (ascending bounds)."""
    rows = []
    for part in text.split(','):
        bound, sep, k = part.strip().partition(':')
        if not sep or not bound.strip().isdigit() or not k.strip().isdigit():
            raise ValueError(f"draft schedule {text!r}: write 'batch:K' pairs, e.g. '1:4,4:2,8:0'")
        rows.append((int(bound), int(k)))
    if [b for b, _ in rows] != sorted({b for b, _ in rows}) or rows[0][0] < 1:
        raise ValueError(f'draft schedule {text!r}: batch sizes must be >= 1 and ascending')
    return rows
