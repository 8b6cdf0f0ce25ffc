"""Where drafted tokens come from. The acceptance rule does not care: a drafter returns tokens and,
when it has them, the distributions q they were sampled from (None means point masses, which keeps
speculative sampling exact for deterministic drafters such as prompt lookup).

A `Drafter` is shared by all requests; `new_request(cfg)` gives the per-request state (a KV cache, an
n-gram index, ...). How many tokens to ask for each step is the decoder's `DraftLengthPolicy`.

Under continuous batching (batching.py) the scheduler asks once per step for every speculating request:
`propose_batch`. Prompt lookup proposes row by row; a model draft runs its one-token steps for all rows
in one batched call (`ModelDrafter.propose_batch`), each row's proposal the same as its `propose` alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from specpipe.contract.costs import DEFAULT_MODEL_DRAFT_COST, DEFAULT_VERIFY_PER_TOKEN, StepCosts
from specpipe.contract.generation import GenerationConfig, SamplingConfig
from specpipe.engines.base import Engine, EngineBatch
from specpipe.speculative.adaptive import draft_confidence_floor
from specpipe.speculative.sampling import sample, shape_probs


@dataclass
class Proposal:
    tokens: list[int]  # [k] drafted token ids, k <= the k asked for (0 = draft nothing this step)
    probs: Optional[np.ndarray] = None  # [k, V_target] the q each token was drawn from; None = point masses
    copied: bool = False  # copied by prompt lookup where an EAGLE-3 head was unsure (speculative/eagle3.py)

    @classmethod
    def empty(cls) -> "Proposal":
        return cls([], None)


class DraftSession(ABC):
    # Set by the request when its K adapts (adaptive.ExpectedSpeedupDraftLength.worth_another): told the top
    # probabilities of the tokens drafted so far this step, whether one more pays. None: draft up to k.
    worth_another: Optional[Callable[[Sequence[float]], bool]] = None
    # Set with it under adaptive K (adaptive.ExpectedSpeedupDraftLength.tokens_per_cost): a step's expected tokens per
    # cost for drafts of known chances (`copied`: copied from the context after one draft step). None otherwise.
    tokens_per_cost: Optional[Callable[..., float]] = None
    # True: the session ends a step by its tokens' confidence (`_Drafted.go_on`), so it is asked for the policy's
    # ceiling rather than its K (adaptive.DraftLengthPolicy.ceiling). Prompt lookup has no confidence.
    stops_by_confidence: bool = False

    @abstractmethod
    def propose(self, context: Sequence[int], k: int, sampling: SamplingConfig, rng: np.random.Generator) -> Proposal:
        """Propose up to k tokens to follow `context` (prompt + tokens emitted so far)."""

    def observe(self, num_drafted: int, accepted_len: int) -> None:
        """Told after each verification how many of the drafted tokens were accepted."""

    def observe_features(self, first_position: int, features: np.ndarray) -> None:
        """A drafter that `reads_features` is told, after each verification, the target's features
        [n, F] of context positions first_position .. first_position + n - 1 (those the target call computed)."""

    def close(self) -> None:
        """Told once when the request leaves, so the session frees what it holds (a batched draft's row)."""


class Drafter(ABC):
    name: str = "drafter"
    reads_features: bool = False  # True: its sessions need the target's hidden states (EAGLE-3)

    @abstractmethod
    def new_request(self, cfg: Optional[GenerationConfig] = None) -> DraftSession:
        """Per-request state; `cfg` is the request's config (None: defaults)."""

    def for_batch(self, max_rows: int) -> "Drafter":
        """The drafter a scheduler of up to `max_rows` requests at once uses: this one, unless the drafter can
        draft for several requests in one call (ModelDrafter). Its sessions must be closed when requests leave."""
        return self

    def propose_batch(self, sessions: Sequence[DraftSession], contexts: Sequence[Sequence[int]], ks: Sequence[int],
                      samplings: Sequence[SamplingConfig], rngs: Sequence[np.random.Generator]) -> list[Proposal]:
        """One proposal per session, each what `sessions[i].propose(contexts[i], ks[i], samplings[i], rngs[i])`
        gives. This default proposes row by row (prompt lookup: each row searches its own context)."""
        return [session.propose(context, k, sampling, rng)
                for session, context, k, sampling, rng in zip(sessions, contexts, ks, samplings, rngs)]

    def default_costs(self) -> StepCosts:
        """Costs adaptive K assumes when none were measured for the built engines (see adaptive.py)."""
        return StepCosts(draft=DEFAULT_MODEL_DRAFT_COST, verify_per_token=DEFAULT_VERIFY_PER_TOKEN)


class ModelDrafter(Drafter):
    """A small causal LM with the target's tokenizer proposes k tokens autoregressively.

    `max_rows` (set by `for_batch`): the requests' draft caches are rows of one engine batch, a row per
    request, released when it leaves, so `propose_batch` runs one draft call for all rows' next tokens."""

    name = "model"

    def __init__(self, engine: Engine, target_vocab_size: int, max_rows: Optional[int] = None):
        self.engine = engine
        self.target_vocab_size = target_vocab_size
        # A sliced head (engine.token_ids): which of its columns the target can score, found once.
        self.kept_columns = None if engine.token_ids is None else engine.token_ids < target_vocab_size
        self.rows: Optional[EngineBatch] = engine.new_batch(max_rows) if max_rows else None

    def new_request(self, cfg: Optional[GenerationConfig] = None) -> DraftSession:
        return ModelDraftSession(self, cfg or GenerationConfig())

    def for_batch(self, max_rows: int) -> "ModelDrafter":
        return ModelDrafter(self.engine, self.target_vocab_size, max_rows=max_rows)

    def propose_batch(self, sessions, contexts, ks, samplings, rngs) -> list[Proposal]:
        """`propose` for every row at once: row i gets exactly what sessions[i].propose would give it (the same
        tokens, the same q, drawn from rngs[i] in the same order), but each one-token draft step is one call
        for all rows still drafting (engines/shared_kv.py: only one-token-per-row calls batch).

          1. catch up: rows with one token to append (after a rejection) run in one call; rows with more (a
             draft accepted whole + the bonus token, a first step) run alone;
          2. draft: every row still drafting picks its next token from its latest logits; a row that has its k
             tokens or stops after its last (`_Drafted.go_on`) is done; the others append theirs in one call.
        Example, ks = [3, 1, 2], one token each to catch up, nobody unsure: one call catches all three up and they
        pick x_1; rows 0 and 2 append x_1 in one call and pick x_2; row 0 appends x_2 alone and picks x_3. Three
        draft calls where row-by-row proposing makes six (3 + 1 + 2)."""
        if self.rows is None or any(getattr(session, "drafter", None) is not self for session in sessions):
            return super().propose_batch(sessions, contexts, ks, samplings, rngs)
        logits = self._catch_up(sessions, contexts)  # per row [V_draft]: the draft's scores for the next token
        drafts = [_Drafted() for _ in sessions]
        drafting = [i for i, k in enumerate(ks) if k > 0]
        while drafting:
            for i in drafting:
                drafts[i].add(*sessions[i].pick(logits[i], samplings[i], rngs[i]))
            drafting = [i for i in drafting
                        if len(drafts[i].tokens) < ks[i] and drafts[i].go_on(sessions[i], _top_probability(logits[i]))]
            step = self.rows.decode([sessions[i].seq for i in drafting], [drafts[i].tokens[-1] for i in drafting])
            for row, i in enumerate(drafting):
                logits[i] = step[row]
        return [draft.proposal() for draft in drafts]

    def _catch_up(self, sessions, contexts) -> list[np.ndarray]:
        """Make each row's cache hold its context (`EngineSequence.sync`); returns each row's last logits."""
        tails = [session.seq.rewind_to(context) for session, context in zip(sessions, contexts)]
        logits: list[Optional[np.ndarray]] = [None] * len(sessions)
        single = [i for i, tail in enumerate(tails) if len(tail) == 1]
        step = self.rows.decode([sessions[i].seq for i in single], [tails[i][0] for i in single])
        for row, i in enumerate(single):
            logits[i] = step[row]
        for i, tail in enumerate(tails):
            if len(tail) > 1:
                logits[i] = sessions[i].seq.append(tail, last=1)[-1]
        return logits


@dataclass
class _Drafted:
    """A proposal being built: its tokens and, when sampled, the q of each."""

    tokens: list[int] = field(default_factory=list)
    q_rows: list[np.ndarray] = field(default_factory=list)  # each [V_target]; empty under greedy
    confidences: list[float] = field(default_factory=list)  # the draft's top probability at each token

    def add(self, token: int, q: Optional[np.ndarray]) -> None:
        self.tokens.append(token)
        if q is not None:
            self.q_rows.append(q)

    def go_on(self, session: DraftSession, confidence: float) -> bool:
        """After a token drafted with this top probability (of the draft's own softmax, T = 1, so it means the
        same under greedy and sampling; tokens a sliced head does not score have q = 0, so the same either way):
        whether to draft another. Not after a token under the session's floor (the tokens after it are likely
        rejected, and each costs a draft step), nor when the request's cost rule says one more does not pay."""
        self.confidences.append(confidence)
        if confidence < session.min_confidence:
            return False
        return session.worth_another is None or session.worth_another(self.confidences)

    def proposal(self) -> Proposal:
        return Proposal(self.tokens, np.stack(self.q_rows) if self.q_rows else None)


class ModelDraftSession(DraftSession):
    stops_by_confidence = True

    def __init__(self, drafter: ModelDrafter, cfg: GenerationConfig):
        self.drafter = drafter
        # A row of the drafter's batch when it serves a batch of requests, else a cache of its own.
        self.seq = drafter.rows.new_sequence() if drafter.rows is not None else drafter.engine.new_sequence()
        # Stop drafting after a token the draft was unsure of (_Drafted.go_on).
        self.min_confidence = draft_confidence_floor(cfg)
        self.closed = False

    def propose(self, context, k, sampling, rng) -> Proposal:
        logits = self.seq.sync(context, last=1)[-1]
        draft = _Drafted()
        for _ in range(k):
            draft.add(*self.pick(logits, sampling, rng))
            if len(draft.tokens) == k or not draft.go_on(self, _top_probability(logits)):
                break
            logits = self.seq.append(draft.tokens[-1:])[-1]
        return draft.proposal()

    def pick(self, logits: np.ndarray, sampling: SamplingConfig, rng: np.random.Generator) -> tuple[int, Optional[np.ndarray]]:
        """The next drafted token from the draft's logits [V_draft], and the q [V_target] it was drawn from
        (None under greedy: a point mass)."""
        token_ids = self.drafter.engine.token_ids
        if sampling.greedy and token_ids is not None:
            return int(token_ids[logits.argmax()]), None  # a sliced head: argmax among the tokens it scores
        if sampling.greedy:
            return int(self._in_target_vocab(logits).argmax()), None
        q = shape_probs(self._in_target_vocab(logits), sampling)[0]
        return sample(q, rng), q

    def close(self) -> None:
        if self.drafter.rows is not None and not self.closed:
            self.drafter.rows.release(self.seq)
        self.closed = True

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
