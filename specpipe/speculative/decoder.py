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


from specpipe.contract.costs import StepCosts
from specpipe.contract.generation import GenerationConfig
from specpipe.engines.base import Engine
from specpipe.speculative.drafters import Drafter, Proposal
from specpipe.speculative.settle import RequestState, settle
from specpipe.speculative.stats import SpecStats


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
        request = RequestState(list(prompt_ids), cfg, stats, eos)
        request.start(self.target.new_sequence(), self.drafter, self.costs, self.target.max_seq_len)
        while not request.finished:
            k = min(request.draft_k(), request.room())

            # 1. Draft: up to k tokens x_1..x_k, with the q they were drawn from.
            t0 = time.perf_counter()
            proposal = request.draft.propose(request.context, k, cfg.sampling, request.rng) if k > 0 else Proposal.empty()
            t1 = time.perf_counter()

            # 2. Verify: one target call on [last context token, x_1..x_k] gives p for K+1 positions (the first
            #    call also runs the prompt before them).
            request.features_from = len(request.row)
            #    The logits are lent (the engine's buffer): settle reads them before the next call.
            call = request.context[len(request.row) :] + proposal.tokens
            target_logits = request.row.append_lent(call, last=len(proposal.tokens) + 1)
            t2 = time.perf_counter()
            if request.features_from:  # not the prompt's call: a decoding step's verify call, timed by its size
                stats.time_call(len(call), t2 - t1)

            # 3. Accept each x_i with min(1, p/q); resample the first rejection from norm(max(0, p - q));
            #    if all are accepted, add a bonus token from the target (settle.py).
            yield settle(request, proposal, target_logits, draft_s=t1 - t0, target_s=t2 - t1)
