"""How many tokens to draft each step: a fixed K, or a K that adapts to each request.

Adaptive drafting (the default) picks, after every verification, the K that maximises the expected
speedup of the next step (Leviathan et al. 2023, section 3.5: the improvement factor of Theorem 3.8),

    speedup(K) = (1 + a + a^2 + ... + a^K) / (V(K) + c K),   V(K) = 1 + b K when only b is known


    a: the per-token acceptance rate, estimated from this request's recent verifications;
    c: the cost of one draft step relative to one target step (0 for prompt lookup);
    b: the extra cost of each verified token relative to one target step (the paper takes b = 0, a
       GPU verifying K tokens as fast as one; on a CPU a 5-token verification costs ~1.13 steps);
    V(K): a target call on 1 + K tokens relative to one step, measured per K where the build recorded it
       (StepCosts.verify: on an int8 CPU target it is a staircase, not a line).

c, b and V are measured on the built engines (builder/measure.py, stored in the manifest), so the same
rule drafts long when drafts are free and usually right (prompt lookup while the answer copies its input)
and short when the draft is costly or usually wrong. That K is a ceiling: within a step, a model draft or an
EAGLE-3 head drafts one more token only while its own confidence says the step's expected tokens per cost
rise (`worth_another`), and never after a token below `min_draft_confidence` (transformers'
`assistant_confidence_threshold`, llama.cpp's `p_min`; `draft_confidence_floor`). transformers' schedule (+2
after a fully accepted draft, -1 otherwise) remains available as `draft_length="heuristic"` (floor only).

No rule looks at the target's distribution before verification, so the acceptance rule stays exact: they
change how many tokens are drafted, never how a drafted token is accepted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from specpipe.contract.costs import BatchCosts, StepCosts
from specpipe.contract.generation import GenerationConfig


class DraftLengthPolicy(ABC):
    """Owned by the decoder, one per request: `k` is how many tokens to ask the draft for next."""

    k: int

    @abstractmethod
    def observe(self, num_drafted: int, accepted_len: int) -> None:
        """Told after each verification how many drafted tokens there were and how many were accepted."""

    @property
    def ceiling(self) -> int:
        """What a draft that ends its steps by its own confidence (DraftSession.stops_by_confidence) is asked
        for: k, unless the policy's cost rule (`worth_another`) ends its steps."""
        return self.k

    def worth_another(self, confidences: Sequence[float]) -> bool:
        """Told the draft's top probabilities of the tokens drafted so far this step: whether to draft one more
        (within k). These policies always do; ExpectedSpeedupDraftLength asks the costs."""
        return True


class FixedDraftLength(DraftLengthPolicy):
    def __init__(self, k: int):
        self.k = k

    def observe(self, num_drafted: int, accepted_len: int) -> None:
        pass


class AdaptiveDraftLength(DraftLengthPolicy):
    """`draft_length="heuristic"`, transformers' schedule: grow K by 2 after a fully accepted draft, shrink it by 1 after a rejection.

    A step that drafted nothing (prompt lookup found no match) says nothing about K and leaves it alone.
    Example, start 4, max 8, (drafted, accepted): (4,4) -> 6, (6,6) -> 8, (8,8) -> 8, (8,3) -> 7, (0,0) -> 7.
    """

    GROW, SHRINK = 2, 1

    def __init__(self, start: int, max_len: int, min_len: int = 1):
        if not 1 <= min_len <= start <= max_len:
            raise ValueError(f"need 1 <= min_len {min_len} <= start {start} <= max_len {max_len}")
        self.k, self.min_len, self.max_len = start, min_len, max_len

    def observe(self, num_drafted: int, accepted_len: int) -> None:
        if num_drafted == 0:
            return
        if accepted_len == num_drafted:
            self.k = min(self.k + self.GROW, self.max_len)
        else:
            self.k = max(self.k - self.SHRINK, self.min_len)


PRIOR_WEIGHT = 4.0  # drafted tokens a build-measured acceptance counts for; the decay (0.7) settles near 3.3


class ExpectedSpeedupDraftLength(DraftLengthPolicy):
    """K = argmax over 1..max_len of speedup(K) (module docstring), re-chosen after each verification.

    The acceptance rate a is estimated from discounted counts, so it follows a request that moves between
    copying its input (a near 1) and writing new text: each verification of n drafts with m accepted adds
    m successes out of m trials, plus one failed trial if a draft was rejected; older counts decay by
    `decay` per step, and a Beta(1, 1) prior keeps a in (0, 1). Steps that drafted nothing (prompt lookup
    without a match) carry no information and leave K alone.
    Example, c = 0 (prompt lookup), b = 0.035, decay 0.7, max 16: accepting 4 of 4 and then 10 of 10 moves
    the estimate to 0.83 and 0.93 and K from 4 to 10 and 16; a rejection of the first of 16 drops it to
    0.83 and K to 10. With c = 0.12 (a model draft) the same sequence gives K 5, 10, 5.
    """

    def __init__(self, costs: StepCosts, start: int, max_len: int, decay: float = 0.7):
        if not 1 <= start <= max_len:
            raise ValueError(f"need 1 <= start {start} <= max_len {max_len}")
        self.costs, self.max_len, self.decay = costs, max_len, decay
        self.k, self.successes, self.trials = start, 0.0, 0.0

    @property
    def acceptance(self) -> float:
        return (self.successes + 1.0) / (self.trials + 2.0)

    def start_from(self, acceptance: float, weight: float = PRIOR_WEIGHT) -> None:
        """Begin from a measured acceptance (the build's, for this draft) worth `weight` drafted tokens,
        instead of the uninformed 0.5: a request's first steps then speculate as much as the draft has earned."""
        self.successes, self.trials = acceptance * weight, weight
        self.k = best_draft_length(self.acceptance, self.costs, self.max_len)

    @property
    def ceiling(self) -> int:
        """k is best for a draft whose every token has the mean acceptance; a draft that knows its confidence token
        by token is asked for up to max_len and stopped by `worth_another`: a sure run of tokens goes past k, an
        unsure token ends the step before it."""
        return self.max_len

    def worth_another(self, confidences: Sequence[float]) -> bool:
        """Told the draft's top probabilities of the tokens drafted so far this step: whether one more pays
        (`worth_another`, below), the next token's chance taken as this request's acceptance estimate."""
        return worth_another(confidences, self.acceptance, self.costs)

    def tokens_per_cost(self, chances: Sequence[float], copied: bool = False) -> float:
        """`tokens_per_cost` (below) on this request's costs: a drafter that knows its tokens' chances (an EAGLE-3
        head's prompt-lookup copies, speculative/eagle3.py) weighs its options with it."""
        return tokens_per_cost(chances, self.costs, copied)

    def observe(self, num_drafted: int, accepted_len: int) -> None:
        if num_drafted == 0:
            return
        self.successes = self.decay * self.successes + accepted_len
        self.trials = self.decay * self.trials + accepted_len + (accepted_len < num_drafted)
        self.k = best_draft_length(self.acceptance, self.costs, self.max_len)


def expected_speedup(k: int, acceptance: float, costs: StepCosts) -> float:
    """Expected tokens per step over the step's cost, both relative to target-only decoding."""
    tokens = sum(acceptance**i for i in range(k + 1))  # accepted drafts + the recovered or bonus token
    return tokens / costs.step_cost(k)


def worth_another(confidences: Sequence[float], acceptance: float, costs: StepCosts) -> bool:
    """Whether drafting one more token raises this step's expected tokens per cost (EAGLE-2's observation: a
    draft's confidence tracks its acceptance, so the step's length can follow it instead of a fixed K).

    confidences: the draft's top probability at each token drafted so far, taken as that token's chance of
    acceptance given the earlier ones (measured calibrated for a distilled EAGLE-3 head, docs/eagle3-decoding.md);
    the next token's chance, unknown before its draft step, is `acceptance`. With k tokens drafted, the step
    yields 1 + p1 + p1 p2 + ... tokens for costs.step_cost(k), and one more adds p1 ... pk * acceptance for
    step_cost(k + 1). Example, int8-wo target (verify of 1+1 / 1+2 tokens 1.08 / 1.25 steps), c = 0.1, a = 0.5:
    after p1 = 0.9 another pays (1.9 / 1.18 = 1.61 < 2.35 / 1.45 = 1.62), after p1 = 0.6 it does not."""
    return tokens_per_cost([*confidences, acceptance], costs) > tokens_per_cost(confidences, costs)


def tokens_per_cost(chances: Sequence[float], costs: StepCosts, copied: bool = False) -> float:
    """Expected tokens of a step that drafts len(chances) tokens, token i accepted with chance chances[i] given the
    earlier ones were (1 + p1 + p1 p2 + ...: the accepted drafts and the target's own token), over the step's cost
    relative to one target step. `copied`: the tokens were copied from the context after one draft step (an
    EAGLE-3 head's prompt lookup, speculative/eagle3.py), so the step pays its verification and that one draft
    step, not one per token. Example, int8-wo target (verify of 1+1 / 1+2 tokens 1.08 / 1.25 steps), c = 0.1:
    [0.5] 1.5 / 1.18 = 1.27; [0.5, 0.6] 1.8 / 1.45 = 1.24 drafted, 1.8 / 1.35 = 1.33 copied."""
    chain = tokens = 1.0
    for p in chances:
        chain *= p
        tokens += chain
    k = len(chances)
    return tokens / (costs.verify_cost(k) + costs.draft * (min(k, 1) if copied else k))


def best_draft_length(acceptance: float, costs: StepCosts, max_len: int) -> int:
    return max(range(1, max_len + 1), key=lambda k: expected_speedup(k, acceptance, costs))


def predicted_speedup(acceptance: float, costs: StepCosts, max_len: int) -> float:
    """The speedup over the target alone this model predicts for a draft with this per-token acceptance on
    engines with these costs, drafting its best K. Below 1.0 the draft makes decoding slower.
    Example: acceptance 0.3, c = 0.12, b = 0.035 -> K = 1, (1 + 0.3) / 1.155 = 1.13x; acceptance 0.1 -> 0.95x."""
    return expected_speedup(best_draft_length(acceptance, costs, max_len), acceptance, costs)


def draft_length_policy(cfg: GenerationConfig, costs: StepCosts) -> DraftLengthPolicy:
    if cfg.draft_length == "fixed":
        return FixedDraftLength(cfg.num_draft_tokens)
    if cfg.draft_length == "heuristic":
        return AdaptiveDraftLength(start=cfg.num_draft_tokens, max_len=cfg.max_draft_tokens)
    return ExpectedSpeedupDraftLength(costs, start=cfg.num_draft_tokens, max_len=cfg.max_draft_tokens)


def draft_confidence_floor(cfg: GenerationConfig) -> float:
    """The top draft probability under which a model draft stops early; 0 (never stop) when K is fixed,
    so a fixed K drafts exactly K tokens (benchmarks sweep K)."""
    return cfg.min_draft_confidence if cfg.draft_length != "fixed" else 0.0


def plan_batch_draft_lengths(acceptances: list[float], preferred: list[int], costs: StepCosts,
                             batch: BatchCosts, draft_batch: BatchCosts | None = None) -> list[int]:
    """K for each request of one batched step (0 = no speculation): the choice of maximal goodput.

    A request that decodes joins the one batched call (each added row costs the batch's marginal step); a
    request that speculates with K runs its own call on 1 + K tokens (engines/shared_kv.py: ONNX Runtime
    cannot verify several rows' drafts in one call) and drafts K tokens, and emits E(K) = 1 + a + ... + a^K
    tokens on average. Requests are ranked by how many tokens per ms speculation earns them alone, and the
    best j speculate, for the j that maximises (tokens of the step) / (time of the step). At low load this is
    the single-request rule (speculate when E(K) / cost(K) beats one token per step); under load the
    batched call makes a decoded token cheaper than a verified one, and speculation turns off request by
    request. vLLM's and TensorRT-LLM's batch-size -> K tables say the same by hand (`draft_schedule`).

    The speculating rows' drafts cost c K target steps each, as if alone; with `draft_batch` (the draft
    engine's batched one-token steps, measured at build) their draft steps run together
    (ModelDrafter.propose_batch): draft step s is one call over the rows with K >= s.
    Example, decode_ms {1: 30, 16: 90}, c = 0.05, b = 0.04, a = 0.6, K = 3: alone, 2.18 tokens / 39.3 ms beats
    1 / 30 ms; in a batch of 16, speculating one row adds 39.3 ms for 1.18 more tokens, while the batched
    call makes 16 tokens in 90 ms: every row decodes."""
    step_one = batch.decode(1)
    n = len(acceptances)

    def expected_tokens(a: float, k: int) -> float:
        return sum(a**i for i in range(k + 1))

    def lone_ms(k: int) -> float:
        return step_one * costs.step_cost(k)

    def speculating_ms(ks: list[int]) -> float:
        """The speculating rows' share of the step: each verifies alone; their drafts run alone or batched."""
        if draft_batch is None:
            return sum(lone_ms(k) for k in ks)
        verify = sum(step_one * costs.verify_cost(k) for k in ks)
        return verify + sum(draft_batch.decode(sum(k >= s for k in ks)) for s in range(1, max(ks) + 1))

    gain = [expected_tokens(a, k) / lone_ms(k) if k > 0 else 0.0 for a, k in zip(acceptances, preferred)]
    order = sorted(range(n), key=lambda i: -gain[i])
    best_j, best_rate = 0, n / batch.decode(n) if n else 0.0
    tokens, speculating = 0.0, []
    for j, i in enumerate(order, start=1):
        if preferred[i] <= 0:
            break
        tokens += expected_tokens(acceptances[i], preferred[i])
        speculating.append(preferred[i])
        # The batched call still spans the speculating rows' slots (they carry a dummy token), so it costs
        # decode(n) while any row decodes.
        rate = (tokens + n - j) / (speculating_ms(speculating) + (batch.decode(n) if j < n else 0.0))
        if rate > best_rate:
            best_j, best_rate = j, rate
    chosen = set(order[:best_j])
    return [preferred[i] if i in chosen else 0 for i in range(n)]


def scheduled_draft_length(schedule: list[tuple[int, int]], batch_size: int) -> int:
    """A user's batch-size -> K table (`[(up_to_batch, k), ...]`, ascending; vLLM's
    num_speculative_tokens_per_batch_size, TensorRT-LLM's draft_len_schedule): K of the first row whose
    bound covers `batch_size`; 0 beyond the last."""
    for up_to, k in schedule:
        if batch_size <= up_to:
            return k
    return 0
