"""One request's decoding state, and the step that settles each target call (Leviathan et al. 2023, Algorithm 1,
step 3, with the bookkeeping around it). The single-request loop (decoder.py) and the batching scheduler
(batching.py) both call `settle`, so a request's tokens, statistics and stopping are the same in either.

A request's target cache (`row`) holds its context but the newest token between steps: the next target call feeds
that token first, then the step's drafts, and scores K+1 positions (verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from specpipe.contract.costs import StepCosts
from specpipe.contract.generation import GenerationConfig
from specpipe.engines.base import EngineSequence
from specpipe.speculative.adaptive import DraftLengthPolicy, draft_length_policy
from specpipe.speculative.drafters import DraftSession, Drafter, Proposal
from specpipe.speculative.stats import SpecStats
from specpipe.speculative.verify import judge


@dataclass
class RequestState:
    prompt_ids: list[int]
    cfg: GenerationConfig
    stats: SpecStats
    eos_token_ids: set[int]
    context: list[int] = field(default_factory=list)  # prompt + emitted tokens
    produced: int = 0  # tokens emitted
    hit_eos: bool = False  # stop_on_eos and the last emitted token is an EOS
    row: Optional[EngineSequence] = None  # the target's cache
    max_seq_len: int = 0  # the target's
    draft: Optional[DraftSession] = None  # None: the target alone
    draft_len: Optional[DraftLengthPolicy] = None  # this request's K
    reads_features: bool = False  # its drafter reads the target's features (EAGLE-3)
    features_from: int = 0  # the first position the row's last target call ran
    rng: Optional[np.random.Generator] = None

    def start(self, row: EngineSequence, drafter: Optional[Drafter], costs: StepCosts, max_seq_len: int) -> None:
        """Open the request on its target row: its context is the prompt, its draft session and K policy new."""
        self.context, self.row, self.max_seq_len = list(self.prompt_ids), row, max_seq_len
        self.rng = np.random.default_rng(self.cfg.seed)
        speculating = self.cfg.speculative and drafter is not None
        self.draft = drafter.new_request(self.cfg) if speculating else None
        self.reads_features = speculating and drafter.reads_features
        if self.reads_features:
            row.keep_features()  # its target calls also give the features its drafter reads
        self.draft_len = draft_length_policy(self.cfg, costs)  # fixed K, or K adapted to this request
        if self.draft is not None:  # an adaptive K is a ceiling: the draft stops when one more does not pay
            self.draft.worth_another = self.draft_len.worth_another
            self.draft.tokens_per_cost = getattr(self.draft_len, "tokens_per_cost", None)  # adaptive K only

    def draft_k(self) -> int:
        """Tokens to ask the draft for this step (before `room`): 0 without a draft; the policy's K; or, for a draft
        that ends its steps by its own confidence, the policy's ceiling (adaptive.py `worth_another`)."""
        if self.draft is None:
            return 0
        return self.draft_len.ceiling if self.draft.stops_by_confidence else self.draft_len.k

    def room(self) -> int:
        """Tokens that may still be drafted: a step also adds one target token, within both limits."""
        return min(self.cfg.max_new_tokens - self.produced, self.max_seq_len - len(self.context)) - 1

    @property
    def finished(self) -> bool:
        return self.hit_eos or self.room() < 0

    def observe_features(self, context_positions: int) -> None:
        """Hand a drafter that reads features those of the positions the row's last target call ran, from
        `features_from`, that are context: the positions before `context_positions`."""
        if self.reads_features:
            first = self.features_from
            self.draft.observe_features(first, self.row.features[: context_positions - first])


def settle(request: RequestState, proposal: Proposal, target_logits: np.ndarray, *, draft_s: float,
           target_s: float) -> list[int]:
    """Judge one step and apply it: accept each x_i with min(1, p/q), resample the first rejection from
    norm(max(0, p - q)) or add the bonus token (verify.py); tell the draft; cut the emitted tokens at EOS and at
    max_new_tokens; count them; roll the cache back to the context but the newest token. target_logits: [K+1,
    vocab], the target's scores of the last context token and the K drafts. Returns the emitted tokens."""
    verdict = judge(proposal.tokens, proposal.probs, target_logits, request.cfg.sampling, request.rng)
    if request.draft is not None:
        request.draft.observe(len(proposal.tokens), verdict.accepted_len)
        request.draft_len.observe(len(proposal.tokens), verdict.accepted_len)
    emitted = verdict.emitted(proposal.tokens)
    if request.cfg.stop_on_eos:
        emitted = cut_at_eos(emitted, request.eos_token_ids)
    emitted = emitted[: request.cfg.max_new_tokens - request.produced]  # at least one: room() >= 0 before a step
    request.hit_eos = request.cfg.stop_on_eos and emitted[-1] in request.eos_token_ids
    request.stats.record(len(proposal.tokens), verdict.accepted_len, len(emitted), copied=proposal.copied)
    request.stats.draft_s += draft_s
    request.stats.target_s += target_s
    request.row.truncate(len(request.context) + verdict.accepted_len)
    request.context += emitted
    request.produced += len(emitted)
    request.observe_features(len(request.context) - 1)  # all but the newest token are context
    return emitted


def cut_at_eos(tokens: list[int], eos_token_ids: set[int]) -> list[int]:
    """The tokens up to and including the first EOS."""
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: i + 1]
    return tokens
