"""Text in, streamed text out: tokenizer + speculative decoder + stop strings + timing.

The same `SpecGenerator` runs in-process (`specpipe generate`) and inside the Triton model.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

from specpipe.contract.costs import StepCosts
from specpipe.contract.generation import GenerationConfig
from specpipe.engines.base import Engine
from specpipe.errors import UsageError, require_text
from specpipe.speculative.decoder import SpeculativeDecoder
from specpipe.speculative.drafters import Drafter
from specpipe.speculative.stats import SpecStats


@dataclass
class Chunk:
    text: str  # new text since the previous chunk (whole characters only)
    token_ids: list[int]  # tokens emitted by this step


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos" | "length" | "stop"
    stats: SpecStats
    prompt_len: int
    ttft_ms: float
    total_ms: float
    num_generated: int = field(init=False)

    def __post_init__(self):
        self.num_generated = len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / (self.total_ms / 1e3) if self.total_ms > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode_ms = self.total_ms - self.ttft_ms
        return (self.num_generated - 1) / (decode_ms / 1e3) if decode_ms > 0 and self.num_generated > 1 else 0.0

    def as_dict(self) -> dict:
        stats = self.stats.as_dict()
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "num_generated": self.num_generated,
            "prompt_len": self.prompt_len,
            "finish_reason": self.finish_reason,
            "drafted": stats.pop("drafted"),
            "accepted": stats.pop("accepted"),
            "acceptance_rate": stats.pop("acceptance_rate"),
            "mean_accepted_len": stats.pop("mean_accepted_len"),
            "ttft_ms": self.ttft_ms,
            "total_ms": self.total_ms,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            **stats,
        }


def _text_of(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, straight through a fast tokenizer's Rust tokenizer where
    that is all transformers' decode does (no clean-up of tokenization spaces): 0.8 against 10.5 us a call, twice a
    step (SmolLM2-135M, Zen 4), 0.2-0.5 ms of a loaded target-only step's ~1 ms of Python."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Decodes a growing token list into text deltas without splitting a UTF-8 character.

    Keeps a small window (prefix_offset..read_offset) so each call decodes a few tokens, not all.
    A trailing U+FFFD means the last token ended inside a multi-byte character: wait for more.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decode = _text_of(tokenizer)
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_ids: Sequence[int]) -> str:
        self.token_ids.extend(token_ids)
        prefix_text = self.decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self.decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end (a trailing partial character decodes as U+FFFD)."""
        prefix_text = self.decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self.decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]


class Generation:
    """One running request: iterate for `Chunk`s; `result` is set when iteration ends."""

    def __init__(self, generator: "SpecGenerator", prompt_ids: list[int], cfg: GenerationConfig):
        self.prompt_ids, self.cfg = prompt_ids, cfg
        self.stats = SpecStats()
        self._decoder = generator.decoder
        self._eos = generator.eos_token_ids
        self._detok = IncrementalDetokenizer(generator.tokenizer)
        self.result: Optional[Result] = None

    def __iter__(self) -> Iterator[Chunk]:
        start = time.perf_counter()
        ttft_ms = 0.0
        text, sent, token_ids, finish = "", 0, [], "length"
        hold = max((len(s) for s in self.cfg.stop), default=1) - 1  # chars that may start a stop string
        steps = self._decoder.decode(self.prompt_ids, self.cfg, self.stats, self._eos)
        for emitted in steps:
            if not token_ids:
                ttft_ms = (time.perf_counter() - start) * 1e3
            token_ids += emitted
            text += self._detok.add(emitted)
            stop_at = _find_stop(text, self.cfg.stop, sent)
            if stop_at is not None:
                text, finish = text[:stop_at], "stop"
                steps.close()
                break
            if self.cfg.stop_on_eos and emitted[-1] in self._eos:
                finish = "eos"
            safe = len(text) - hold if finish == "length" and hold else len(text)
            if safe > sent:
                yield Chunk(text[sent:safe], emitted)
                sent = safe
            elif emitted:
                yield Chunk("", emitted)
        if finish != "stop":
            text += self._detok.flush()
        if len(text) > sent:
            yield Chunk(text[sent:], [])
        self.result = Result(
            text=text,
            token_ids=token_ids,
            finish_reason=finish,
            stats=self.stats,
            prompt_len=len(self.prompt_ids),
            ttft_ms=ttft_ms,
            total_ms=(time.perf_counter() - start) * 1e3,
        )


def check_context(prompt_len: int, max_new_tokens: int, max_seq_len: int) -> None:
    """Refuse, before any work, a request whose prompt + max new tokens exceed the engine's context.

    An error rather than a silent cap: a run that quietly ends at the context end looks like a model that
    stopped early, and the caller cannot tell "length" from "no room". TensorRT-LLM refuses the same request.
    The one check behind `specpipe generate`, the in-process API and the Triton model."""
    if prompt_len + max_new_tokens <= max_seq_len:
        return
    room = max_seq_len - prompt_len
    fits = f"at most {room} new tokens fit after this prompt" if room > 0 else "the prompt alone fills it"
    raise UsageError(
        f"prompt ({prompt_len} tokens) + max_tokens ({max_new_tokens}) = {prompt_len + max_new_tokens}"
        f" exceeds the engine's max_seq_len {max_seq_len}: {fits}"
    )


def _find_stop(text: str, stops: list[str], sent: int) -> Optional[int]:
    """Earliest index of a stop string in the not-yet-final part of `text`, or None."""
    hits = [text.find(s, max(0, sent - len(s))) for s in stops if s]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else None


class SpecGenerator:
    """`decoder`: a SpeculativeDecoder (one request at a time, made here by default) or a BatchScheduler
    (speculative/batching.py: requests decode together); both have `decode()` with one signature."""

    def __init__(self, target: Engine, drafter: Optional[Drafter], tokenizer, eos_token_ids: Sequence[int] = (),
                 costs: Optional[StepCosts] = None, *, decoder=None):
        self.tokenizer = tokenizer
        eos = set(eos_token_ids) or ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.eos_token_ids = set(int(t) for t in eos)
        self.decoder = decoder or SpeculativeDecoder(target, drafter, eos, costs)

    def with_eos(self, eos_token_ids: Sequence[int]) -> "SpecGenerator":
        """The same engines and decoder, with other EOS ids (TensorRT-LLM's per-request end_id)."""
        other = copy.copy(self)
        other.eos_token_ids = set(int(t) for t in eos_token_ids)
        return other

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if not prompt:
            raise UsageError("the prompt is empty")
        require_text(prompt, "the prompt")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise UsageError("--chat: this tokenizer has no chat template")
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
        else:
            ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise UsageError("the prompt encodes to no tokens")
        return list(ids)

    def start(self, prompt_ids: list[int], cfg: GenerationConfig) -> Generation:
        check_context(len(prompt_ids), cfg.max_new_tokens, self.decoder.target.max_seq_len)
        return Generation(self, prompt_ids, cfg)

    def generate(self, prompt: str | list[int], cfg: GenerationConfig, chat: bool = False) -> Result:
        prompt_ids = self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
        generation = self.start(prompt_ids, cfg)
        for _ in generation:
            pass
        return generation.result
