"""The EAGLE-3 drafter (Li et al. 2025): a head that reads the target's own features drafts k tokens.

Per request the head keeps its own KV cache with one row per context position i, made from the target's features
f_i and the next token t_{i+1} (engines/eagle3_head.py; the convention distill/eagle3.py trains). The decoder hands
the session the features of every position its target call computed that became context (`observe_features`);
`propose` appends the rows still missing, up to the last context position but one (row L-2 reads t_{L-1}, the
newest token), and drafts on from there on the head's own states, as training-time test unrolls it:

    context t_0 .. t_{L-1}; rows 0..L-2 cached     row L-2's logits          -> x_1   (predicts t_L)
    draft step j (position L-2+j):  state of the previous call, token x_j     -> x_{j+1}

after which the draft positions leave the cache: the target's features replace them once verified. Before the
target has run (the first step) there are no features, so the first step drafts nothing: it is the prompt's
prefill, as in target-only decoding.

q over the target's vocabulary: the head's softmax placed on its draft tokens (column d = target token
d + d2t[d]), 0 for every token outside its draft vocabulary, so the acceptance rule stays exact under sampling.

Where the head is unsure of x_1 (its top probability under `lookup_below`) and the context has a match, prompt
lookup (ngram.py) drafts the step instead: up to LOOKUP_MAX_TOKENS tokens copied from the context, point masses
(q = 1 on each), so the rule stays exact; the choice reads only the context, never the target. The head is
calibrated (its top probability ~ how often its x_1 is the target's), while a lookup match is right about as often
whatever the head thinks, so below the threshold the copy is the better draft (docs/eagle3-decoding.md).

Under adaptive K (as deployed) each request also learns how its copies fare (`CopyOdds`: the chance a copy's first
token is accepted, and that a copied run which started right stays right), because that differs by request and by
machine: on code a copy is right about half the time, on chat about one time in five. Below the threshold the step
then weighs both options by expected tokens per cost (adaptive.tokens_per_cost, the verify curve measured at build):
the copy, as many of its tokens as pay, against the head's own x_1 at its top probability. Where a verified token
costs little (an fp32 target) a long copy pays even when it is seldom right; where each costs 0.1-0.2 of a step (an
int8-wo target on a CPU) a short one or none. Under a fixed K (benchmark sweeps) a step below the threshold copies
min(k, LOOKUP_MAX_TOKENS), as before.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from specpipe.contract.costs import DEFAULT_VERIFY_PER_TOKEN, StepCosts
from specpipe.contract.generation import GenerationConfig, SamplingConfig
from specpipe.speculative.adaptive import draft_confidence_floor
from specpipe.speculative.drafters import Drafter, DraftSession, Proposal, _Drafted, _top_probability
from specpipe.speculative.ngram import NgramDrafter
from specpipe.speculative.sampling import sample, shape_probs

# One head step against one target step, when none was measured for the engines at hand: SmolLM2-135M's head
# (35 MB of fp32 matrices against the target's 540 MB) measured 0.068 of an fp32 target step on a 2-core CPU, less
# with its matrices in bf16 (docs/eagle3-decoding.md).
DEFAULT_HEAD_DRAFT_COST = 0.05

# Prompt lookup drafts a step where the head's top probability for x_1 is under this, and copies at most this many
# tokens. Measured on the 12 packaged code prompts with the fresh demo's head (AVX2 Zen 3, docs/eagle3-decoding.md):
# the head's x_1 was right 0.03-0.31 of the time where its top probability was under 0.4, a lookup match 0.44-0.68
# in the same places, and both ~0.4-0.5 between 0.4 and 0.5.
LOOKUP_BELOW = 0.4
LOOKUP_MAX_TOKENS = 4

# A request's copies before it has shown its own (CopyOdds): in the same measurement a lookup match was right ~0.45
# of the time where the head was unsure, and a copied run that started right stayed right 0.61-0.66 of the time at
# its 2nd-4th token. Each prior counts as COPY_PRIOR_WEIGHT judged tokens; older outcomes decay by COPY_DECAY a copy.
COPY_FIRST_PRIOR = 0.45
COPY_STAY_PRIOR = 0.65
COPY_PRIOR_WEIGHT = 4.0
COPY_DECAY = 0.8


class CopyOdds:
    """One request's estimates for its prompt-lookup copies: `first`, the chance a copy's first token is accepted,
    and `stay`, the chance a copied token is accepted after the copy's earlier ones were. Discounted counts over
    the copies verified so far, each estimate starting from its prior worth COPY_PRIOR_WEIGHT tokens.
    Example: after copies judged (4 drafted, 0 accepted) three times, first = 0.45 * 4 * 0.8^3 / (4 * 0.8^3 + 2.44)
    = 0.20 and stay stays 0.65 (no copied token was judged after an accepted one)."""

    def __init__(self):
        self._first = [COPY_FIRST_PRIOR * COPY_PRIOR_WEIGHT, COPY_PRIOR_WEIGHT]  # [successes, trials]
        self._stay = [COPY_STAY_PRIOR * COPY_PRIOR_WEIGHT, COPY_PRIOR_WEIGHT]

    @property
    def first(self) -> float:
        return self._first[0] / self._first[1]

    @property
    def stay(self) -> float:
        return self._stay[0] / self._stay[1]

    def observe(self, drafted: int, accepted: int) -> None:
        """A copy of `drafted` tokens whose first `accepted` were accepted: token 1 was judged, and token i > 1 was
        judged only if tokens 1..i-1 were accepted."""
        if drafted <= 0:
            return
        for counts, successes, trials in ((self._first, min(accepted, 1), 1),
                                          (self._stay, max(accepted - 1, 0), min(accepted, drafted - 1))):
            counts[0] = COPY_DECAY * counts[0] + successes
            counts[1] = COPY_DECAY * counts[1] + trials

    def chances(self, n: int) -> list[float]:
        """The chance of each of a copy's first n tokens, given the earlier ones were accepted."""
        return [self.first] + [self.stay] * (n - 1) if n > 0 else []

    def length(self, available: int, tokens_per_cost) -> int:
        """How many of `available` copied tokens to draft: the most tokens per cost (`tokens_per_cost(chances,
        copied=True)`), lengthened one token at a time while that rises. Example, int8-wo target (verify of 1+1 ..
        1+4 tokens 1.02, 1.19, 1.30, 1.46 steps, a head step 0.12), the priors 0.45 / 0.65: 1.27, 1.33, 1.36, 1.30
        tokens per step for 1..4 tokens: 3."""
        def rate(n: int) -> float:
            return tokens_per_cost(self.chances(n), copied=True)

        n = 1
        while n < available and rate(n + 1) > rate(n):
            n += 1
        return n


class Eagle3Drafter(Drafter):
    """`head`: an EAGLE-3 head engine (drafts/eagle3.py `open_head`: torch or ONNX Runtime) whose feature
    layers the target engine outputs."""

    name = "eagle3"
    reads_features = True

    def __init__(self, head, target_vocab_size: int, *, lookup: Optional[NgramDrafter] = None,
                 lookup_below: float = LOOKUP_BELOW):
        self.head = head
        self.target_vocab_size = target_vocab_size
        # prompt lookup where the head is unsure (module docstring); lookup_below = 0 turns it off
        self.lookup = lookup if lookup is not None else NgramDrafter()
        self.lookup_below = lookup_below

    def new_request(self, cfg: Optional[GenerationConfig] = None) -> "Eagle3DraftSession":
        return Eagle3DraftSession(self, cfg or GenerationConfig())

    def default_costs(self) -> StepCosts:
        return StepCosts(draft=DEFAULT_HEAD_DRAFT_COST, verify_per_token=DEFAULT_VERIFY_PER_TOKEN)


class Eagle3DraftSession(DraftSession):
    stops_by_confidence = True

    def __init__(self, drafter: Eagle3Drafter, cfg: GenerationConfig):
        self.drafter, self.head = drafter, drafter.head
        self.cache = self.head.new_cache()  # row i = context position i (draft steps only while proposing)
        self.features = np.zeros((0, self.head.feature_width), np.float32)  # target features of positions...
        self.features_from = 0  # ...features_from, features_from + 1, ... not yet in the cache
        self.min_confidence = draft_confidence_floor(cfg)  # as ModelDraftSession: stop after an unsure token
        self.lookup = drafter.lookup.new_request(cfg) if drafter.lookup_below > 0 else None
        self.copy_odds = CopyOdds()  # how this request's copies fare (read under the cost rule: adaptive K)
        self.copying = False  # the last proposal was a copy

    def observe_features(self, first_position: int, features: np.ndarray) -> None:
        """features [n, F]: the target's features of positions first_position .. first_position + n - 1, all of
        them context now. Rows from first_position on are (re)made from these."""
        self.cache.truncate(min(len(self.cache), first_position))
        if not len(self.features) or first_position < self.features_from:
            self.features, self.features_from = features, first_position
            return
        if first_position > self.features_from + len(self.features):
            raise ValueError(f"features from position {first_position}, but none known from {self.features_from + len(self.features)}")
        self.features = np.concatenate([self.features[: first_position - self.features_from], features])

    def propose(self, context: Sequence[int], k: int, sampling: SamplingConfig, rng: np.random.Generator) -> Proposal:
        rows, last_row = len(self.cache), len(context) - 2  # cached rows 0..rows-1; rows up to last_row needed
        have = self.features_from + len(self.features)  # features known for positions < have
        if last_row < rows or self.features_from > rows or have <= last_row:
            return Proposal.empty()  # no features yet (the first step) or none for the newest position
        # Context rows rows..last_row: feature f_i with token t_{i+1}.
        new = self.features[rows - self.features_from : last_row + 1 - self.features_from]
        logits, state = self.head.context_rows(self.cache, context[rows + 1 : last_row + 2], new)
        self.features, self.features_from = self.features[last_row + 1 - self.features_from :], last_row + 1
        copied = self._copy(_top_probability(logits), context, k, sampling, rng)
        self.copying = copied is not None
        if copied is not None:
            return copied  # point masses; the cache holds the context rows only, as after a head draft
        draft = _Drafted()
        for _ in range(k):
            draft.add(*self.pick(logits, sampling, rng))
            if len(draft.tokens) == k or not draft.go_on(self, _top_probability(logits)):
                break
            logits, state = self.head.draft_step(self.cache, draft.tokens[-1], state)
        self.cache.truncate(last_row + 1)  # the draft positions leave; verified ones come back from features
        return draft.proposal()

    def _copy(self, confidence: float, context: Sequence[int], k: int, sampling: SamplingConfig,
              rng: np.random.Generator) -> Optional[Proposal]:
        """The lookup's copy, where the head is unsure of x_1 (top probability `confidence` under the threshold) and
        the context has a match; under adaptive K only as long as pays, and only if that beats the head's x_1
        (module docstring). None: the head drafts."""
        if self.lookup is None or confidence >= self.drafter.lookup_below:
            return None
        copied = self.lookup.propose(context, min(k, LOOKUP_MAX_TOKENS), sampling, rng)
        if not copied.tokens:
            return None
        rate = self.tokens_per_cost
        if rate is not None:
            n = self.copy_odds.length(len(copied.tokens), rate)
            if rate(self.copy_odds.chances(n), copied=True) <= rate([confidence]):
                return None
            copied.tokens = copied.tokens[:n]
        copied.copied = True
        return copied

    def observe(self, num_drafted: int, accepted_len: int) -> None:
        if self.copying:
            self.copy_odds.observe(num_drafted, accepted_len)

    def pick(self, logits: np.ndarray, sampling: SamplingConfig, rng: np.random.Generator) -> tuple[int, Optional[np.ndarray]]:
        """The next drafted token from the head's logits [draft_vocab_size] and the q [V_target] it was drawn from
        (None under greedy: a point mass). Draft ids are sorted target ids, so argmax picks the same token in
        either numbering."""
        token_ids = self.head.token_ids
        if sampling.greedy:
            return int(token_ids[logits.argmax()]), None
        row = np.full(self.drafter.target_vocab_size, -np.inf, dtype=np.float32)
        row[token_ids] = logits
        q = shape_probs(row, sampling)[0]
        return sample(q, rng), q
