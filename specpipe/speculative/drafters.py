"""Where drafted tokens come from. The acceptance rule does not care: a drafter returns tokens and,
when it has them, the distributions q they were sampled from (None means point masses, which keeps
speculative sampling exact for deterministic drafters such as prompt lookup).

A `Drafter` is shared by all requests; `new_request(cfg)` gives the per-request state (a KV cache, an
n-gram index, ...). How many tokens to ask for each step is the decoder's `DraftLengthPolicy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from specpipe.config import GenerationConfig, SamplingConfig
from specpipe.engines.base import Engine
from specpipe.speculative.adaptive import DEFAULT_MODEL_DRAFT_COST, DEFAULT_VERIFY_PER_TOKEN, StepCosts, draft_confidence_floor
from specpipe.speculative.sampling import sample, shape_probs


@dataclass
class Proposal:
    tokens: list[int]  # [k] drafted token ids, k <= the k asked for (0 = draft nothing this step)
    probs: Optional[np.ndarray] = None  # [k, V_target] the q each token was drawn from; None = point masses

    @classmethod
    def empty(cls) -> "Proposal":
        return cls([], None)


class DraftSession(ABC):
    @abstractmethod
    def propose(self, context: Sequence[int], k: int, sampling: SamplingConfig, rng: np.random.Generator) -> Proposal:
        """Propose up to k tokens to follow `context` (prompt + tokens emitted so far)."""

    def observe(self, num_drafted: int, accepted_len: int) -> None:
        """Told after each verification how many of the drafted tokens were accepted."""


class Drafter(ABC):
    name: str = "drafter"

    @abstractmethod
    def new_request(self, cfg: Optional[GenerationConfig] = None) -> DraftSession:
        """Per-request state; `cfg` is the request's config (None: defaults)."""

    def default_costs(self) -> StepCosts:
        """Costs adaptive K assumes when none were measured for the built engines (see adaptive.py)."""
        return StepCosts(draft=DEFAULT_MODEL_DRAFT_COST, verify_per_token=DEFAULT_VERIFY_PER_TOKEN)


class ModelDrafter(Drafter):
    """A small causal LM with the target's tokenizer proposes k tokens autoregressively."""

    name = "model"

    def __init__(self, engine: Engine, target_vocab_size: int):
        self.engine = engine
        self.target_vocab_size = target_vocab_size
        # A sliced head (engine.token_ids): which of its columns the target can score, found once.
        self.kept_columns = None if engine.token_ids is None else engine.token_ids < target_vocab_size

    def new_request(self, cfg: Optional[GenerationConfig] = None) -> DraftSession:
        return ModelDraftSession(self, cfg or GenerationConfig())


class ModelDraftSession(DraftSession):
    def __init__(self, drafter: ModelDrafter, cfg: GenerationConfig):
        self.drafter = drafter
        self.seq = drafter.engine.new_sequence()
        # Stop drafting after a token the draft was unsure of: the tokens after it are likely rejected,
        # and each costs a draft call. Confidence = top probability of the draft's own softmax (T = 1),
        # so it means the same under greedy and sampling.
        self.min_confidence = draft_confidence_floor(cfg)

    def propose(self, context, k, sampling, rng) -> Proposal:
        logits = self.seq.sync(context)[-1]
        token_ids = self.drafter.engine.token_ids
        tokens, q_rows = [], []
        for i in range(k):
            if sampling.greedy and token_ids is not None:
                token = int(token_ids[logits.argmax()])  # a sliced head: argmax among the tokens it scores
            elif sampling.greedy:
                token = int(self._in_target_vocab(logits).argmax())
            else:
                q_i = shape_probs(self._in_target_vocab(logits), sampling)[0]
                token = sample(q_i, rng)
                q_rows.append(q_i)
            tokens.append(token)
            # Tokens a sliced head does not score have q = 0, so its top probability is the same either way.
            if i + 1 == k or _top_probability(logits) < self.min_confidence:
                break
            logits = self.seq.append([token])[-1]
        return Proposal(tokens, np.stack(q_rows) if q_rows else None)

    def _in_target_vocab(self, logits: np.ndarray) -> np.ndarray:
        """Draft logits over the target's vocabulary, so q never proposes a token the target cannot score:
        padded columns beyond it are dropped, missing ones are -inf, and a sliced head's columns
        (engine.token_ids) go back to their token ids with -inf (q = 0) everywhere else."""
        vocab = self.drafter.target_vocab_size
        token_ids = self.drafter.engine.token_ids
        if token_ids is not None:
            row = np.full(vocab, -np.inf, dtype=logits.dtype)
            keep = self.drafter.kept_columns
            row[token_ids[keep]] = logits[keep]
            return row
        if len(logits) >= vocab:
            return logits[:vocab]
        return np.concatenate([logits, np.full(vocab - len(logits), -np.inf, dtype=logits.dtype)])


def _top_probability(logits: np.ndarray) -> float:
    """max(softmax(logits)) without forming the softmax: 1 / sum(exp(logits - max))."""
    return float(1.0 / np.exp(logits - logits.max()).sum())
