"""How a deployment decodes: its draft length K in one place.

`DecodingPolicy` is what TensorRT-LLM's `DecodingBaseConfig` is to its decoding types
(tensorrt_llm/llmapi/llm_args.py at the pin engines/upstream.py cites: `max_draft_len`, `draft_len_schedule`,
one subclass per `decoding_type`): each draft kind (specpipe/drafts/) names its subclass. The manifest records
what the build chose (`max_draft_len`, `serving.draft_schedule`); `Manifest.decoding` hands it back as the
draft kind's policy, and every stage after the build (serving, the gate, bench) asks that policy for a
request's settings through one rule, `DecodingPolicy.request`:

    num_draft_tokens None  as deployed: adaptive K, at most max_draft_len (and the batch schedule when served)
    num_draft_tokens 0     the target alone
    num_draft_tokens K     exactly K drafts per step (refused above max_draft_len)
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Optional

from pydantic import BeforeValidator, Field, PlainSerializer

from specpipe.config import Strict
from specpipe.contract.generation import GenerationConfig
from specpipe.errors import EngineError, UsageError


def parse_draft_schedule(text: str) -> dict[int, int]:
    """'1:4,4:2,8:0' -> {1: 4, 4: 2, 8: 0}: batch sizes up to the key draft the value (keys ascending)."""
    rows = []
    for part in text.split(','):
        bound, sep, k = part.strip().partition(':')
        if not sep or not bound.strip().isdigit() or not k.strip().isdigit():
            raise ValueError(f"draft schedule {text!r}: write 'batch:K' pairs, e.g. '1:4,4:2,8:0'")
        rows.append((int(bound), int(k)))
    if [b for b, _ in rows] != sorted({b for b, _ in rows}) or rows[0][0] < 1:
        raise ValueError(f'draft schedule {text!r}: batch sizes must be >= 1 and ascending')
    return dict(rows)


def _schedule(value: Any) -> Any:
    """A schedule as users write it ('1:4,4:2') or as a mapping ({1: 4, 4: 2}, JSON's string keys too)."""
    if isinstance(value, str):
        return parse_draft_schedule(value)
    if isinstance(value, dict):
        return parse_draft_schedule(",".join(f"{b}:{k}" for b, k in value.items()))
    return value


def schedule_text(schedule: dict[int, int]) -> str:
    """{1: 4, 4: 2} -> '1:4,4:2' (how --draft-schedule and the manifest write it)."""
    return ",".join(f"{bound}:{k}" for bound, k in schedule.items())


# The one schedule format: {up to batch size b: K}, keys ascending, no speculation above the largest key (TensorRT-LLM's
# reading of draft_len_schedule at the pin, engines/upstream.py). Written as its text ('1:4,4:2,8:0') in configs and
# manifests, as it always was.
DraftSchedule = Annotated[dict[int, int], BeforeValidator(_schedule), PlainSerializer(schedule_text, return_type=str)]


class DecodingPolicy(Strict):
    """A deployment's decoding: the draft kind's `decoding_type`, the K the engines were built for and the batch
    schedule. A subclass per draft kind (its module in specpipe/drafts/) says which backends run it."""

    decoding_type: ClassVar[Optional[str]] = None  # TensorRT-LLM's name for it (engines/upstream.py DECODING_TYPES)
    backends: ClassVar[tuple[str, ...]] = ("onnxruntime", "tensorrt", "trtllm")

    max_draft_len: int = Field(8, ge=1, description="largest K the engines are built for (BuildConfig.max_draft_len)")
    draft_len_schedule: Optional[DraftSchedule] = Field(
        None, description="batch size -> K under load; None = adaptive K chooses per step by goodput")

    @classmethod
    def supports_backend(cls, backend: str) -> bool:
        return backend in cls.backends

    @staticmethod
    def requested(k: Optional[int]) -> dict[str, Any]:
        """The GenerationConfig fields a requested K sets: None = as deployed (none), 0 = the target alone,
        K = exactly K per step. A request that carries no GenerationConfig yet (Triton's tensors) uses this."""
        if k is None:
            return {}
        if k < 0:
            raise UsageError(f"num_draft_tokens must be >= 0 (0 = target only), got {k}")
        if k == 0:
            return {"speculative": False}
        return {"speculative": True, "num_draft_tokens": k, "draft_length": "fixed"}

    def request(self, k: Optional[int] = None, **fields) -> GenerationConfig:
        """One request's GenerationConfig on this deployment: `fields` (GenerationConfig's), with the requested K's
        rule (`requested`) over them, and K kept within max_draft_len: a fixed K beyond it is refused, an adaptive
        K capped."""
        cfg = GenerationConfig(**{**fields, **self.requested(k)})
        if cfg.draft_length != "fixed":
            ceiling = min(cfg.max_draft_tokens, self.max_draft_len)
            return cfg.model_copy(update={"max_draft_tokens": ceiling, "num_draft_tokens": min(cfg.num_draft_tokens, ceiling)})
        if cfg.num_draft_tokens > self.max_draft_len:
            raise EngineError(f"num_draft_tokens {cfg.num_draft_tokens} > max_draft_len {self.max_draft_len} this deployment was built for")
        return cfg

    @property
    def adaptive_ceiling(self) -> int:
        """The largest K adaptive drafting tries on this deployment (as served)."""
        return self.request().max_draft_tokens

    def schedule_rows(self) -> Optional[list[tuple[int, int]]]:
        """The schedule as the batch scheduler reads it ([(up_to_batch, K), ...]); None = the goodput plan."""
        return list(self.draft_len_schedule.items()) if self.draft_len_schedule else None
