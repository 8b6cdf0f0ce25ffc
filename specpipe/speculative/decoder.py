"""The speculative decoding loop (Leviathan et al. 2023, Algorithm 1), token ids in, token ids out.

Each step: (1) the draft proposes K tokens; (2) the target scores the last context token and all K
drafts in one call; (3) drafts are accepted or rejected, and one recovered or bonus token is added.
Target-only decoding is the same loop with nothing drafted, so the baseline runs the same engine code.
A drafter that reads the target's hidden states (EAGLE-3, speculative/eagle3.py) is told the features of the
positions each target call verified; only then does the target compute them.
"""

from __future__ import annotations

import time
from typing import Iterator, Optional, Sequence

import numpy as np

from specpipe.contract.costs import StepCosts
from specpipe.contract.generation import GenerationConfig
from specpipe.engines.base import Engine
from specpipe.speculative.adaptive import draft_length_policy
from specpipe.speculative.drafters import Drafter, Proposal
from specpipe.speculative.stats import SpecStats
from specpipe.speculative.verify import judge


class SpeculativeDecoder:
    def __init__(self, target: Engine, drafter: Optional[Drafter], eos_token_ids: Sequence[int] = (),
                 costs: Optional[StepCosts] = None):
        self.target = target
        self.drafter = drafter
        self.eos_token_ids = set(int(t) for t in eos_token_ids)
        self.costs = costs or (drafter.default_costs() if drafter is not None else StepCosts(0.0, 0.0))

    def decode(self, prompt_ids: Sequence[int], cfg: GenerationConfig, stats: SpecStats,
               eos_token_ids: Optional[Sequence[int]] = None) -> Iterator[list[int]]:
        """Yield the tokens emitted by each step (1..K+1 of them) until EOS or max_new_tokens.
        `eos_token_ids` replaces the decoder's for this request."""
        eos = self.eos_token_ids if eos_token_ids is None else set(int(t) for t in eos_token_ids)
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token")
        rng = np.random.default_rng(cfg.seed)
        target = self.target.new_sequence()
        draft = self.drafter.new_request(cfg) if (cfg.speculative and self.drafter is not None) else None
        reads_features = draft is not None and self.drafter.reads_features
        if reads_features:
            target.keep_features()
        draft_len = draft_length_policy(cfg, self.costs)  # fixed K, or K adapted to this request
        context, produced = list(prompt_ids), 0
        while produced < cfg.max_new_tokens:
            room = min(cfg.max_new_tokens - produced, self.target.max_seq_len - len(context)) - 1
            if room < 0:
                return
            k = min(draft_len.k, room) if draft is not None else 0

            # 1. Draft: up to k tokens x_1..x_k, with the q they were drawn from.
            t0 = time.perf_counter()
            proposal = draft.propose(context, k, cfg.sampling, rng) if k > 0 else Proposal.empty()
            t1 = time.perf_counter()

            # 2. Verify: one target call on [last context token, x_1..x_k] gives p for K+1 positions.
            #    (The cache may already hold the last context token, if it equals a rejected draft: drop it.)
            target.truncate(min(len(target), len(context) - 1))
            computed = target.sync(context + proposal.tokens)  # logits of the positions this call ran
            target_logits = computed[-(len(proposal.tokens) + 1) :]
            t2 = time.perf_counter()

            # 3. Accept each x_i with min(1, p/q); resample the first rejection from norm(max(0, p - q));
            #    if all are accepted, add a bonus token from the target.
            verdict = judge(proposal.tokens, proposal.probs, target_logits, cfg.sampling, rng)
            if draft is not None:
                draft.observe(len(proposal.tokens), verdict.accepted_len)
                draft_len.observe(len(proposal.tokens), verdict.accepted_len)

            emitted = verdict.emitted(proposal.tokens)
            if cfg.stop_on_eos:
                emitted = _cut_at_eos(emitted, eos)
            emitted = emitted[: cfg.max_new_tokens - produced]
            stats.record(len(proposal.tokens), verdict.accepted_len, len(emitted))
            stats.draft_s += t1 - t0
            stats.target_s += t2 - t1
            context += emitted
            produced += len(emitted)
            if reads_features:  # the features of the positions that became context: all but the newest token
                first = len(target) - len(computed)
                draft.observe_features(first, target.features[: len(context) - 1 - first])
            yield emitted
            if cfg.stop_on_eos and emitted[-1] in eos:
                return


def _cut_at_eos(tokens: list[int], eos_token_ids: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: i + 1]
    return tokens
