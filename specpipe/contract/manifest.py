"""engines/<name>/manifest.json: what was built, from what, with which versions, and how it checked out.

`Manifest` is the contract between `build`, which writes it, and everything that opens a build (the
deployment, the gate, bench, the Triton repository): readers name fields, never look up keys. The JSON is
format 1 as it always was: a field added after the first builds is optional, and an optional part (default
None) is written only when present, so a manifest reads back as it was written. Records of measurements
other modules define (quantization's numbers, a candidate's measurement) keep every key they were written
with; the fields typed here are the ones specpipe reads back.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping, Optional

from pydantic import (BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, ValidationInfo, field_validator,
                      model_serializer, model_validator)

from specpipe.contract.costs import BatchCosts, StepCosts
from specpipe.contract.decoding import DecodingPolicy, DraftSchedule
from specpipe.contract.quant import AccuracyBudget, QuantMode
from specpipe.contract.quant import AccuracyReport
from specpipe.errors import EngineError
from specpipe.machine import library_versions

MANIFEST = "manifest.json"
FORMAT = 1


# Where a TensorRT-LLM build runs (its manifest says so; in-process loading refuses it).
SERVED_BY = "trtllm-serve or Triton on a GPU; gate it with `specpipe validate --endpoint`"

class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_serializer(mode="wrap")
    def _leave_out_absent_parts(self, handler) -> dict[str, Any]:
        fields = type(self).model_fields
        return {key: value for key, value in handler(self).items()
                if value is not None or key not in fields or fields[key].default is not None}  # fmt: skip


class _Record(_Part):
    """Numbers another module measured: typed where specpipe reads them back, every other key kept."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)


class TokenizerRecord(_Part):
    path: str = "tokenizer"  # relative to the build folder
    hash: str


class EngineRecord(_Part):
    path: str  # the engine's folder, relative to the build folder (load_engine opens it)
    backend: Literal["onnxruntime", "tensorrt", "trtllm"] = "onnxruntime"
    quant: QuantMode = "none"
    graph: Literal["optimum", "genai", "hf", "trtllm-engine"] = Field(
        "optimum", description="which exporter made it (builder/cpu.py target_graph, draft_graph); TensorRT-LLM: the Hugging Face "
        "folder its LLM API loads (hf) or a trtllm-build engine (builder/trtllm_manifest.py)")
    files: dict[str, str] = Field(default_factory=dict, description="file name -> sha256")


class ExportCheck(_Part):
    max_abs_diff: float  # engine vs torch logits
    tolerance: float


class QuantCandidate(_Record):
    """One precision `--quant auto` built and measured: its accuracy against the unquantized engine, whether it was
    in budget, and (builds since the choice is timed) its batched step times on this machine. `mode` none is the
    unquantized engine itself: no accuracy numbers, always within budget."""

    mode: QuantMode
    accuracy: Optional[AccuracyReport] = None
    violations: list[dict] = Field(default_factory=list)
    within_budget: bool
    seconds: float  # quantizing and measuring its accuracy (--quant auto: since its quantizers started side by side)
    decode_ms: Optional[dict[int, float]] = None  # rows -> ms of one batched one-token step (as BatchCosts)
    min_rows_per_call: Optional[int] = None  # its 1-token steps ran as this many rows (measure_target_min_rows)

    def tokens_per_s(self, rows: int) -> float:
        """Goodput at `rows` concurrent requests: rows tokens per batched step (sizes between those timed
        interpolate, as the batch planner reads them)."""
        return rows * 1e3 / BatchCosts(self.decode_ms).decode(rows)

    def summary(self, rows: Optional[int] = None) -> str:
        """One line: accuracy and budget verdict, then tokens/s alone and at `rows` requests when it was timed."""
        verdict = "within budget" if self.within_budget else "over budget (" + ", ".join(
            f"{v['metric']} {v['value']:.3g} vs limit {v['limit']:.3g}" for v in self.violations) + ")"
        numbers = "" if self.accuracy is None else (
            f"perplexity {self.accuracy.ppl_rel_change:+.1%}, top-1 agreement {self.accuracy.top1_agreement:.3f}, "
            f"mean KL {self.accuracy.mean_kl:.3f}: ")
        name = "fp32" if self.mode == "none" else self.mode
        speed = ""
        if self.decode_ms:
            speed = f"; 1 row {self.decode_ms[1]:.1f} ms ({self.tokens_per_s(1):.1f} tok/s)"
            if rows is not None and rows > 1:
                speed += f", {rows} rows {BatchCosts(self.decode_ms).decode(rows):.1f} ms ({self.tokens_per_s(rows):.1f} tok/s)"
        took = f" ({self.seconds:.0f} s)" if self.mode != "none" else ""
        return f"{name}: {numbers if self.mode != 'none' else 'the reference: '}{verdict}{speed}{took}"


class QuantRecord(_Record):
    """quantize.quantize_engine's block: the mode, how far the engine drifted, and the budget it was held to."""

    mode: QuantMode
    accuracy: Optional[AccuracyReport] = None  # absent for mode none
    budget: Optional[AccuracyBudget] = None
    reference_path: Optional[str] = None  # the unquantized engine kept beside it (validate --remeasure)
    candidates: Optional[list[QuantCandidate]] = None  # --quant auto: every precision measured; `mode` is the kept one
    load_rows: Optional[int] = None  # --quant auto: the concurrent requests the choice was made for
    reason: Optional[str] = None  # --quant auto: why `mode` (builder/quant_choice.py)


class ConsistencyRecord(_Record):
    """engines/consistency.py: the target's logits for a position alone vs inside a verify call."""

    max_abs_logit_diff: float
    argmax_flips: int
    positions: int
    chunk: int
    exact: bool
    near_tie_tolerance: Optional[float] = None
    within_tolerance: bool = True
    unpadded_max_abs_logit_diff: Optional[float] = None  # when 1-token calls had to run as 2 rows
    # False: the deployment has no draft, so no verify call ever runs; its 1-token calls run unpadded, which keeps
    # them exactly like batched 1-token steps (builder/measure.py `rows_per_call`)
    verify_calls: bool = True


class VocabRecord(_Record):
    """checkpoint/draft_vocab.py: the tokens a sliced draft head scores (the ids themselves are in engine.json)."""

    size: int
    coverage: float


class Prediction(_Part):
    """adaptive K's predicted speedup for the deployed draft, and where its acceptance came from."""

    speedup: float
    acceptance: float
    acceptance_from: str


class ModelEntry(_Part):
    """A model built into an engine: the target, or a draft checkpoint."""

    source: str  # what the user named
    resolved_path: Optional[str] = None
    weights_sha256: Optional[str] = None
    checkpoint: dict[str, Any] = Field(default_factory=dict, description="checkpoint.CheckpointInfo as it was inspected")
    engine: EngineRecord
    export_check: Optional[ExportCheck] = None
    quant: Optional[QuantRecord] = None
    vocab: Optional[VocabRecord] = None  # a draft whose head scores only its most used tokens
    verify_consistency: Optional[ConsistencyRecord] = None  # the target
    min_rows_per_call: int = Field(1, ge=1, description="the target: rows each call runs (engines/onnxruntime.py)")
    prediction: Optional[Prediction] = None  # a draft

    @property
    def quant_mode(self) -> QuantMode:
        return self.quant.mode if self.quant is not None else self.engine.quant

    def paths(self) -> list[str]:
        """Its engine folder, and the unquantized one kept for `validate --remeasure`."""
        return [self.engine.path] + ([self.quant.reference_path] if self.quant and self.quant.reference_path else [])


class DraftEntry(_Part):
    """The manifest's `draft`: one draft kind's record. Each kind (specpipe/drafts/) declares its subclass, with a
    `kind` literal, beside its proposer and its build step; reading a manifest takes the kinds' entry types
    (specpipe.drafts.read_manifest), so this floor names no kind."""

    kind: str
    source: str  # what the user named (the --draft value, or what it resolved to)
    policy: ClassVar[type[DecodingPolicy]] = DecodingPolicy  # the kind's decoding policy (its K and schedule)

    def paths(self) -> list[str]:
        """Its files in the deployment, relative to the build folder."""
        return []


class CandidateMeasurement(_Record):
    """One --draft candidate (or "none", the target alone) as builder/draft_choice.py measured it: greedy, adaptive
    K, every candidate and the target alone on the same prompts in one run; speedup over the target alone."""

    draft: str  # the --draft value
    kind: str  # the draft kind's name (specpipe/drafts/), "none" for the target alone
    prompts: int
    tokens_generated: int
    tokens_per_s: float
    speedup: Optional[float]
    acceptance_rate: Optional[float]  # None for the target alone
    mean_accepted_len: Optional[float]
    matches_target: Optional[int]  # prompts whose token ids equal the target alone's (greedy: all of them)
    step_costs: Optional[StepCosts]  # this candidate's engines, on this machine
    predicted_speedup: Optional[float]  # adaptive K's model for a draft with an engine, at the measured acceptance
    # step_costs.verify is the curve the sample's decoding paid (engines/timing.py `in_decoding_curve`); the curve
    # timed alone before it, and decoding's target calls {tokens: [calls, median ms]} ("1": the target alone's steps)
    verify_timed: Optional[tuple[float, ...]] = None
    verify_calls: Optional[dict[str, list[float]]] = None
    # what was built, so a later build can tell whether it measured the same candidates
    source: str
    weights_sha256: Optional[str]  # a draft checkpoint's
    build_timings_s: dict[str, float]


class ChoiceSample(_Part):
    prompt_sets: list[str]
    prompts_per_set: int
    new_tokens: int
    decoding: str


class DraftChoice(_Part):
    """Several --draft candidates: what each measured, and which was deployed and why."""

    chosen: str
    reason: str
    min_speedup: float
    sample: ChoiceSample
    candidates: list[CandidateMeasurement]
    wall_s: float

    def measurement(self, draft: str) -> CandidateMeasurement:
        return next(m for m in self.candidates if m.draft == draft)


class ServingRecord(_Part):
    """How the served model schedules requests (speculative/batching.py); builds before it served one at a time."""

    max_batch_size: int = 1
    max_queue: int = 0
    draft_schedule: Optional[DraftSchedule] = None  # written as '1:4,4:2'; None = the goodput plan


class Manifest(_Part):
    format: int = FORMAT
    name: str
    created: str
    specpipe_version: Optional[str] = None
    versions: dict[str, str] = Field(default_factory=dict)
    build: dict[str, Any] = Field(default_factory=dict, description="the build's config as the specpipe that built it wrote it")
    tokenizer: TokenizerRecord
    eos_token_ids: list[int] = Field(default_factory=list)
    max_draft_len: int = 8
    step_costs: Optional[StepCosts] = None  # None: built before they were measured; the drafters' defaults apply
    batch_costs: Optional[BatchCosts] = None  # batched target steps by rows; None: batching saves nothing
    draft_batch_costs: Optional[BatchCosts] = None  # batched draft steps by rows; None: each row drafts as if alone
    serving: ServingRecord = Field(default_factory=ServingRecord)
    machine: dict[str, Any] = Field(default_factory=dict, description="specpipe.machine: where step_costs and timings_s were measured")
    target: ModelEntry
    draft: SerializeAsAny[DraftEntry]  # the kind's own entry type (`_draft_of_its_kind`)
    draft_choice: Optional[DraftChoice] = None  # several --draft candidates
    warnings: list[str] = Field(default_factory=list)
    timings_s: dict[str, float] = Field(default_factory=dict)

    @classmethod
    def new(cls, **fields) -> "Manifest":
        """A manifest written now, by this specpipe and these libraries."""
        versions = library_versions()
        return cls(created=now_iso(), specpipe_version=versions["specpipe"], versions=versions, **fields)

    @model_validator(mode="before")
    @classmethod
    def _first_drafts_were_models(cls, data: Any) -> Any:
        """The first builds wrote no draft `kind`: they only built draft models."""
        if isinstance(data, dict) and isinstance(data.get("draft"), dict) and "kind" not in data["draft"]:
            data = {**data, "draft": {**data["draft"], "kind": "model"}}
        return data

    @field_validator("draft", mode="before")
    @classmethod
    def _draft_of_its_kind(cls, data: Any, info: ValidationInfo) -> Any:
        """A draft read from JSON becomes its kind's entry type, from the `draft_entries` the reader passes."""
        if not isinstance(data, dict):
            return data
        entries = (info.context or {}).get("draft_entries")
        if entries is None:
            raise ValueError("a manifest's draft is read with the draft kinds' entry types: use specpipe.drafts.read_manifest")
        if data.get("kind") not in entries:
            raise ValueError(f"draft kind {data.get('kind')!r} is none this specpipe knows ({', '.join(sorted(entries))})")
        return entries[data["kind"]].model_validate(data, context=info.context)

    @property
    def decoding(self) -> DecodingPolicy:
        """How this deployment decodes (K and its schedule), as its draft kind's policy: the one place after the
        build that says which K a request gets (`DecodingPolicy.request`)."""
        return type(self.draft).policy(max_draft_len=self.max_draft_len, draft_len_schedule=self.serving.draft_schedule)

    def draft_acceptance(self) -> Optional[float]:
        """The deployed draft's per-token acceptance as the build measured it (candidate choice), or as its
        prediction assumed; None when neither was recorded."""
        if self.draft_choice is not None:
            chosen = self.draft_choice.measurement(self.draft_choice.chosen)
            if chosen.acceptance_rate is not None:
                return chosen.acceptance_rate
        prediction = getattr(self.draft, "prediction", None)
        return prediction.acceptance if prediction is not None else None

    def deployment_paths(self) -> list[str]:
        """The deployment, relative to its folder: this manifest, the tokenizer and every engine folder it names
        (the unquantized engines kept for `validate --remeasure` too); a build's work files are not in it."""
        paths = [MANIFEST, self.tokenizer.path]
        return list(dict.fromkeys(paths + self.target.paths() + self.draft.paths()))

    def as_dict(self) -> dict[str, Any]:
        """The manifest as JSON values, as write_manifest writes it."""
        return self.model_dump(mode="json")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(Path(folder).iterdir()) if p.is_file()}


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_manifest(folder: Path, manifest: Manifest) -> None:
    (Path(folder) / MANIFEST).write_text(json.dumps(manifest.as_dict(), indent=2) + "\n")


def read_manifest(folder: Path, *, draft_entries: Mapping[str, type[DraftEntry]]) -> Manifest:
    """The manifest in `folder`; `draft_entries`: each draft kind's entry type by name (specpipe.drafts passes them)."""
    path = Path(folder) / MANIFEST
    if not Path(folder).is_dir():
        raise EngineError(f"no such engine folder: {folder}")
    if not path.is_file():
        raise EngineError(f"{folder} is not a specpipe build (no {MANIFEST}); run `specpipe build` first")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise EngineError(f"{path} has format {found!r}; this specpipe reads format {FORMAT}")
    try:
        return Manifest.model_validate(data, context={"draft_entries": draft_entries})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise EngineError(f"{path} is not a specpipe manifest: {problems}") from None
