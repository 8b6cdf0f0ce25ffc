"""Adaptive draft length: the K policy on a scripted acceptance sequence, the decoder asking for that K,
a model draft stopping when unsure, and both leaving the output exact (greedy ids, sampled distribution)."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from specpipe.contract.costs import StepCosts
from specpipe.contract.generation import GenerationConfig, SamplingConfig
from specpipe.speculative.adaptive import (
    AdaptiveDraftLength,
    ExpectedSpeedupDraftLength,
    FixedDraftLength,
    best_draft_length,
    draft_length_policy,
    expected_speedup,
    tokens_per_cost,
    worth_another,
)
from specpipe.speculative.decoder import SpeculativeDecoder
from specpipe.speculative.drafters import Drafter, DraftSession, ModelDrafter, Proposal
from specpipe.speculative.ngram import NgramDrafter
from specpipe.speculative.stats import SpecStats
from specpipe.testing.distribution import chi_square_p, first_two_tokens
from specpipe.testing.engines import BigramEngine

# ---- the policy alone ----


FREE = StepCosts(draft=0.0, verify_per_token=0.035)  # prompt lookup on a CPU
MODEL = StepCosts(draft=0.12, verify_per_token=0.035)  # a distilled draft


def test_expected_speedup_is_the_papers_improvement_factor_when_verification_is_free():
    # Leviathan et al. 2023, Theorem 3.8: (1 - a^(K+1)) / ((1 - a)(cK + 1)).
    for a in (0.1, 0.5, 0.9):
        for c in (0.0, 0.05, 0.3):
            for k in (1, 3, 8):
                paper = (1 - a ** (k + 1)) / ((1 - a) * (c * k + 1))
                assert expected_speedup(k, a, StepCosts(draft=c, verify_per_token=0.0)) == pytest.approx(paper)


def test_best_k_grows_with_acceptance_and_shrinks_with_cost():
    assert [best_draft_length(a, FREE, 32) for a in (0.2, 0.5, 0.8, 0.95)] == [1, 4, 9, 25]
    assert [best_draft_length(a, MODEL, 32) for a in (0.2, 0.5, 0.8, 0.95)] == [1, 2, 5, 12]
    assert best_draft_length(0.95, StepCosts(draft=1.0, verify_per_token=0.035), 32) == 1  # a draft as dear as the target
    assert best_draft_length(0.95, FREE, 8) == 8  # the ceiling holds


def test_expected_speedup_k_follows_a_scripted_acceptance_sequence():
    script = [((4, 4), 10, 5), ((10, 10), 16, 10), ((16, 0), 10, 5), ((0, 0), 10, 5)]  # no draft: no evidence
    free, model = ExpectedSpeedupDraftLength(FREE, start=4, max_len=16), ExpectedSpeedupDraftLength(MODEL, start=4, max_len=16)
    for (drafted, accepted), k_free, k_model in script:
        free.observe(drafted, accepted)
        model.observe(drafted, accepted)
        assert (free.k, model.k) == (k_free, k_model)
    for _ in range(20):
        free.observe(free.k, 0)
    # A draft that is always wrong is cut to one token (the prior keeps a at 1 / (2 + 1/(1 - decay)) = 0.19).
    assert free.k == 1 and free.acceptance == pytest.approx(0.19, abs=0.01)


# An int8 CPU target (the Zen 4 here): verifying 1 or 2 drafts costs 1.08 or 1.25 steps, not 1 + b k.
INT8_CPU = StepCosts(draft=0.1, verify_per_token=0.1, verify=(1.08, 1.25, 1.36))
FP32_CPU = StepCosts(draft=0.05, verify_per_token=0.04)  # verification nearly free, no curve recorded


def test_verify_cost_reads_the_measured_curve_then_extends_it_by_b():
    assert INT8_CPU.verify_cost(0) == 1.0
    assert [INT8_CPU.verify_cost(k) for k in (1, 2, 3)] == [1.08, 1.25, 1.36]
    assert INT8_CPU.verify_cost(5) == pytest.approx(1.36 + 2 * 0.1)
    assert FP32_CPU.verify_cost(4) == pytest.approx(1 + 4 * 0.04)  # no curve: the line through b
    assert INT8_CPU.step_cost(2) == pytest.approx(1.25 + 2 * 0.1)
    assert StepCosts(draft=0.1, verify_per_token=0.1).as_dict()["verify"] == ()  # older manifests read as the line


def test_expected_speedup_charges_the_measured_verify_curve():
    assert expected_speedup(1, 0.5, INT8_CPU) == pytest.approx(1.5 / 1.18)
    assert expected_speedup(2, 0.5, INT8_CPU) == pytest.approx(1.75 / 1.45)
    # The line through b = 0.1 charges K = 2 1.4 steps and picks it at a = 0.55 (1.323 vs 1.292); the measured
    # staircase charges 1.45 and keeps K = 1 (1.314 vs 1.278).
    assert best_draft_length(0.55, StepCosts(draft=0.1, verify_per_token=0.1), 8) == 2
    assert best_draft_length(0.55, INT8_CPU, 8) == 1
    assert best_draft_length(0.9, INT8_CPU, 8) > 1


def test_another_token_is_drafted_only_while_it_raises_tokens_per_cost():
    # int8 target, request acceptance 0.5: after a sure token another pays (1.9 / 1.18 = 1.610 < 2.35 / 1.45 =
    # 1.621), after p = 0.6 it does not (1.356 > 1.310), and the chain's product counts, not the last token alone.
    assert worth_another([0.9], 0.5, INT8_CPU)
    assert not worth_another([0.6], 0.5, INT8_CPU)
    assert not worth_another([0.9, 0.6], 0.5, INT8_CPU)
    # With nearly free verification the same 0.6 is worth following; a weak link later still ends the step.
    assert worth_another([0.6], 0.5, FP32_CPU)
    assert not worth_another([0.9, 0.1], 0.5, FP32_CPU)
    # A request whose drafts are seldom accepted expects little from the next token.
    assert worth_another([0.9], 0.9, INT8_CPU) and not worth_another([0.9], 0.05, INT8_CPU)


def test_tokens_per_cost_charges_a_copy_one_draft_step():
    # The docstring's example, int8 target: [0.5] 1.5 / 1.18; [0.5, 0.6] 1.8 / 1.45 drafted, 1.8 / 1.35 copied (an
    # EAGLE-3 head's prompt-lookup copy pays its one head step whatever its length); nothing drafted: 1 token a step.
    assert tokens_per_cost([0.5], INT8_CPU) == pytest.approx(1.5 / 1.18)
    assert tokens_per_cost([0.5, 0.6], INT8_CPU) == pytest.approx(1.8 / 1.45)
    assert tokens_per_cost([0.5, 0.6], INT8_CPU, copied=True) == pytest.approx(1.8 / 1.35)
    assert tokens_per_cost([], INT8_CPU) == tokens_per_cost([], INT8_CPU, copied=True) == 1.0
    policy = ExpectedSpeedupDraftLength(INT8_CPU, start=1, max_len=8)
    assert policy.tokens_per_cost([0.5, 0.6], copied=True) == pytest.approx(1.8 / 1.35)


# Draft table for the session tests: after token 0 the draft is sure of 1 (0.95), after 1 it picks 2 at 0.6,
# after 2 and 3 it is sure again. Greedy drafting from context [0] goes 1, 2, 3, 0.
SURE_THEN_UNSURE = np.array(
    [
        [0.01, 0.95, 0.02, 0.01, 0.01],
        [0.10, 0.05, 0.60, 0.15, 0.10],
        [0.02, 0.02, 0.02, 0.92, 0.02],
        [0.92, 0.02, 0.02, 0.02, 0.02],
        [0.20, 0.20, 0.20, 0.20, 0.20],
    ]
)


@pytest.mark.parametrize("draft_length, start, costs, expected", [
    ("adaptive", 1, INT8_CPU, [1, 2]),  # 0.95 is worth following, 0.95 x 0.6 is not: the step ends after 2
    ("adaptive", 1, FP32_CPU, [1, 2, 3, 0]),  # cheap verification: the chain is followed to the ceiling
    ("heuristic", 4, INT8_CPU, [1, 2, 3, 0]),  # the floor alone (0.4) never stops this chain
])
def test_a_draft_session_ends_its_step_where_the_cost_rule_says(draft_length, start, costs, expected):
    from specpipe.speculative.settle import RequestState

    cfg = GenerationConfig(draft_length=draft_length, num_draft_tokens=start, max_draft_tokens=4, max_new_tokens=32)
    target = BigramEngine(np.log(SURE_THEN_UNSURE))
    request = RequestState([0], cfg, SpecStats(), set())
    request.start(target.new_sequence(), ModelDrafter(BigramEngine(np.log(SURE_THEN_UNSURE)), 5), costs, 64)
    assert request.draft.stops_by_confidence and request.draft_len.k == start
    k = request.draft_k()
    assert k == 4  # adaptive: the ceiling (max_draft_tokens), not the policy's K of 1; heuristic: its K, 4
    proposal = request.draft.propose(request.context, k, cfg.sampling, request.rng)
    assert proposal.tokens == expected


@pytest.mark.parametrize("draft_length", ["adaptive", "heuristic", "fixed"])
def test_only_adaptive_k_hands_the_draft_its_tokens_per_cost(draft_length):
    """A request's draft session gets the cost rule's tokens_per_cost under adaptive K (an EAGLE-3 head weighs its
    prompt-lookup copies with it, speculative/eagle3.py) and None otherwise (the copy then runs as under a fixed K)."""
    from specpipe.speculative.settle import RequestState

    cfg = GenerationConfig(draft_length=draft_length, num_draft_tokens=2, max_draft_tokens=4, max_new_tokens=8)
    request = RequestState([0], cfg, SpecStats(), set())
    request.start(BigramEngine(np.log(SURE_THEN_UNSURE)).new_sequence(),
                  ModelDrafter(BigramEngine(np.log(SURE_THEN_UNSURE)), 5), INT8_CPU, 64)
    rate = request.draft.tokens_per_cost
    if draft_length == "adaptive":
        assert rate([0.5, 0.6], copied=True) == pytest.approx(tokens_per_cost([0.5, 0.6], INT8_CPU, copied=True))
    else:
        assert rate is None


def test_prompt_lookup_is_asked_for_the_policys_k_not_its_ceiling():
    from specpipe.speculative.settle import RequestState

    cfg = GenerationConfig(max_draft_tokens=16)
    request = RequestState([0, 1, 0], cfg, SpecStats(), set())
    request.start(BigramEngine.random(4, seed=0).new_sequence(), NgramDrafter(), INT8_CPU, 64)
    assert not request.draft.stops_by_confidence  # no confidence to stop by
    assert request.draft_k() == request.draft_len.k < 16


def test_heuristic_k_follows_a_scripted_acceptance_sequence():
    policy = AdaptiveDraftLength(start=4, max_len=8)
    script = [  # (drafted, accepted) -> K after it
        ((4, 4), 6),
        ((6, 6), 8),
        ((8, 8), 8),  # capped at max
        ((8, 3), 7),
        ((7, 0), 6),
        ((0, 0), 6),  # nothing drafted (no n-gram match): no evidence, K stays
        ((2, 2), 8),  # a short draft fully accepted still counts as fully accepted
        ((8, 7), 7),
    ]
    for (drafted, accepted), k_after in script:
        policy.observe(drafted, accepted)
        assert policy.k == k_after
    for _ in range(10):
        policy.observe(policy.k, 0)
    assert policy.k == 1  # floor


def test_fixed_k_never_moves():
    policy = FixedDraftLength(5)
    for drafted, accepted in [(5, 5), (5, 0), (0, 0)]:
        policy.observe(drafted, accepted)
        assert policy.k == 5


def test_policy_from_config():
    assert isinstance(draft_length_policy(GenerationConfig(), FREE), ExpectedSpeedupDraftLength)
    assert isinstance(draft_length_policy(GenerationConfig(draft_length="heuristic"), FREE), AdaptiveDraftLength)
    fixed = draft_length_policy(GenerationConfig(draft_length="fixed", num_draft_tokens=6), FREE)
    assert isinstance(fixed, FixedDraftLength) and fixed.k == 6


@pytest.mark.parametrize(
    "kwargs",
    [
        {"draft_length": "sometimes"},
        {"num_draft_tokens": 9, "max_draft_tokens": 8},  # adaptive K would start above its ceiling
        {"max_draft_tokens": 0},
        {"min_draft_confidence": 1.5},
        {"min_draft_confidence": -0.1},
    ],
)
def test_bad_draft_length_settings_are_refused(kwargs):
    with pytest.raises(ValidationError):
        GenerationConfig(**kwargs)


def test_a_fixed_k_may_exceed_the_adaptive_ceiling():
    assert GenerationConfig(draft_length="fixed", num_draft_tokens=9, max_draft_tokens=8).num_draft_tokens == 9


# ---- the decoder asks for the policy's K ----


class ScriptedDrafter(Drafter):
    """Proposes the target's greedy continuation (all accepted) on good steps, a wrong first token on bad
    ones; records (k asked, tokens proposed) per step."""

    def __init__(self, target: BigramEngine, good_steps: int):
        self.target, self.good_steps = target, good_steps
        self.asked: list[int] = []

    def new_request(self, cfg=None) -> DraftSession:
        drafter = self

        class Session(DraftSession):
            def propose(self, context, k, sampling, rng):
                drafter.asked.append(k)
                tokens, last = [], context[-1]
                for _ in range(k):
                    last = int(drafter.target.table[last].argmax())
                    tokens.append(last)
                if len(drafter.asked) > drafter.good_steps:
                    tokens[0] = (tokens[0] + 1) % drafter.target.vocab_size
                return Proposal(tokens, None)

        return Session()


def _run(decoder, prompt, **cfg):
    stats = SpecStats()
    ids = [t for step in decoder.decode(prompt, GenerationConfig(**cfg), stats) for t in step]
    return ids, stats


def test_decoder_asks_for_the_adaptive_k():
    target = BigramEngine.random(16, seed=0)
    drafter = ScriptedDrafter(target, good_steps=3)
    ids, _ = _run(SpeculativeDecoder(target, drafter, costs=MODEL), [1], max_new_tokens=200)
    policy = ExpectedSpeedupDraftLength(MODEL, start=4, max_len=16)
    expected = [4]
    for step in range(1, 12):  # 3 fully accepted steps, then every first draft is wrong
        policy.observe(expected[-1], expected[-1] if step <= 3 else 0)
        expected.append(policy.k)
    assert drafter.asked[:12] == expected
    assert expected[:4] == [4, 5, 8, 10] and expected[-1] == 1
    assert ids == _run(SpeculativeDecoder(target, None), [1], max_new_tokens=200)[0]


def test_decoder_asks_for_the_heuristic_k():
    target = BigramEngine.random(16, seed=0)
    drafter = ScriptedDrafter(target, good_steps=3)
    ids, _ = _run(SpeculativeDecoder(target, drafter), [1], max_new_tokens=200, draft_length="heuristic", max_draft_tokens=8)
    assert drafter.asked[:12] == [4, 6, 8, 8, 7, 6, 5, 4, 3, 2, 1, 1]
    assert ids == _run(SpeculativeDecoder(target, None), [1], max_new_tokens=200)[0]


def test_num_draft_tokens_fixes_k():
    target = BigramEngine.random(16, seed=0)
    drafter = ScriptedDrafter(target, good_steps=3)
    _run(SpeculativeDecoder(target, drafter), [1], max_new_tokens=200, draft_length="fixed", num_draft_tokens=3)
    assert set(drafter.asked[:-2]) == {3}  # the last steps are cut to the tokens left to emit


# ---- a model draft stops when unsure ----


def _flat(vocab):
    return BigramEngine(np.zeros((vocab, vocab)))  # every row uniform: top probability 1/V


def _peaked(vocab, seed):
    return BigramEngine.random(vocab, seed=seed, scale=30.0)  # top probability ~1


def test_unsure_model_draft_proposes_one_token_per_step():
    target = BigramEngine.random(16, seed=0)
    _, stats = _run(SpeculativeDecoder(target, ModelDrafter(_flat(16), 16)), [1], max_new_tokens=60)
    # One token each step (1/16 < 0.4: stop after the first); the last step drafts nothing (no room).
    assert stats.drafted_at == [stats.steps - 1]


def test_fixed_k_drafts_all_k_even_when_unsure():
    target = BigramEngine.random(16, seed=0)
    _, stats = _run(
        SpeculativeDecoder(target, ModelDrafter(_flat(16), 16)), [1], max_new_tokens=60, draft_length="fixed"
    )
    assert len(stats.drafted_at) == 4 and stats.drafted_at[3] >= stats.steps - 4


def test_confident_model_draft_grows_k_to_the_ceiling():
    target = _peaked(16, seed=0)
    draft_engine = _peaked(16, seed=0)
    _, stats = _run(SpeculativeDecoder(target, ModelDrafter(draft_engine, 16), costs=MODEL), [1], max_new_tokens=200)
    assert stats.acceptance_rate == 1.0
    assert len(stats.drafted_at) == 16 and stats.drafted_at[15] >= stats.steps // 2  # at the ceiling, and stays


@pytest.mark.parametrize("min_confidence", [0.0, 0.4, 0.9])
@pytest.mark.parametrize("noise", [0.5, 3.0])
def test_greedy_equivalence_with_adaptive_k(min_confidence, noise):
    target = BigramEngine.random(32, seed=5, scale=2.0)
    drafter = ModelDrafter(target.perturbed(noise, seed=6), 32)
    prompt = list(np.random.default_rng(7).integers(0, 32, size=20))
    baseline, _ = _run(SpeculativeDecoder(target, None), prompt, max_new_tokens=120)
    spec, stats = _run(SpeculativeDecoder(target, drafter), prompt, max_new_tokens=120, min_draft_confidence=min_confidence)
    assert spec == baseline
    assert stats.drafted > 0


# ---- the exact distribution with early stopping ----

P_TABLE = np.array(
    [
        [0.05, 0.50, 0.20, 0.15, 0.10],
        [0.10, 0.05, 0.35, 0.30, 0.20],
        [0.40, 0.10, 0.10, 0.20, 0.20],
        [0.20, 0.20, 0.20, 0.20, 0.20],
        [0.30, 0.30, 0.10, 0.10, 0.20],
    ]
)
# The draft is sure after tokens 0, 2 and 4 (top probability >= 0.5) and unsure after 1 and 3, so at
# min_draft_confidence 0.45 the draft length depends on what was drafted: early stopping really happens.
Q_TABLE = np.array(
    [
        [0.10, 0.60, 0.10, 0.10, 0.10],
        [0.25, 0.15, 0.30, 0.15, 0.15],
        [0.70, 0.05, 0.05, 0.10, 0.10],
        [0.20, 0.20, 0.20, 0.20, 0.20],
        [0.10, 0.10, 0.10, 0.10, 0.60],
    ]
)
CONTEXT = [0, 1, 2, 0]
RUNS = 20_000


class RecordingDrafter(Drafter):
    def __init__(self, inner: Drafter):
        self.inner, self.lengths = inner, []

    def new_request(self, cfg=None) -> DraftSession:
        session, lengths = self.inner.new_request(cfg), self.lengths

        class Recording(DraftSession):
            def propose(self, context, k, sampling, rng):
                proposal = session.propose(context, k, sampling, rng)
                lengths.append(len(proposal.tokens))
                return proposal

        return Recording()


@pytest.mark.parametrize("drafter_kind", ["model", "ngram"])
def test_adaptive_drafting_emits_the_target_distribution(drafter_kind):
    target = BigramEngine(np.log(P_TABLE))
    inner = ModelDrafter(BigramEngine(np.log(Q_TABLE)), 5) if drafter_kind == "model" else NgramDrafter()
    drafter = RecordingDrafter(inner)
    cfg = GenerationConfig(sampling=SamplingConfig(temperature=1.0), num_draft_tokens=4, min_draft_confidence=0.45)
    samples = first_two_tokens(SpeculativeDecoder(target, drafter), CONTEXT, cfg, RUNS)
    if drafter_kind == "model":
        assert {1, 2, 3, 4} <= set(drafter.lengths), "early stopping must have cut drafts at several lengths"
    first, second = samples[:, 0], samples[:, 1]
    p_values = [chi_square_p(np.bincount(first, minlength=5), P_TABLE[CONTEXT[-1]])]
    for token in range(5):
        given = second[first == token]
        if len(given) >= 1000:
            p_values.append(chi_square_p(np.bincount(given, minlength=5), P_TABLE[token]))
    assert len(p_values) >= 4
    assert min(p_values) > 1e-3, p_values


# ---- on real (tiny) ONNX Runtime engines ----


@pytest.mark.parametrize("min_confidence", [0.0, 0.4, 0.9])
def test_adaptive_greedy_equivalence_on_tiny_onnx_engines(tiny_build, min_confidence):
    from specpipe.deployment import load_deployment
    from specpipe.testing.greedy import assert_greedy_equivalent

    deployment = load_deployment(tiny_build, threads=1)
    for prompt in ["def add(a, b):", "The quick brown fox"]:
        base = deployment.generator.generate(prompt, GenerationConfig(max_new_tokens=40, speculative=False, stop_on_eos=False))
        spec = deployment.generator.generate(
            prompt, GenerationConfig(max_new_tokens=40, stop_on_eos=False, min_draft_confidence=min_confidence)
        )
        assert_greedy_equivalent(deployment, prompt, spec.token_ids, base.token_ids)
        assert spec.stats.drafted > 0


def test_adaptive_k_uses_the_costs_measured_at_build_on_tiny_onnx_engines(tiny_self_build):
    from specpipe.deployment import load_deployment

    deployment = load_deployment(tiny_self_build, threads=1)
    costs = deployment.manifest.step_costs  # measured at build
    assert deployment.costs == costs and 0.0 < costs.draft and 0.0 <= costs.verify_per_token
    # the verify curve too: a call on 1 + k tokens for k = 1..4, never under a step nor under the one before
    assert len(costs.verify) == 4 and 1.0 <= costs.verify[0] and list(costs.verify) == sorted(costs.verify)
    drafter = RecordingDrafter(deployment.drafter)
    decoder = SpeculativeDecoder(deployment.target, drafter, deployment.generator.decoder.eos_token_ids, deployment.costs)
    prompt = deployment.generator.encode("def add(a, b):")
    cfg = deployment.generation_config(max_new_tokens=60, stop_on_eos=False, min_draft_confidence=0.0)
    stats = SpecStats()
    ids = [t for step in decoder.decode(prompt, cfg, stats) for t in step]
    assert stats.acceptance_rate == 1.0 and len(ids) == 60  # a self-draft of the unquantized target agrees
    # Every draft accepted: each K is the one the measured costs make best for the acceptance seen so far.
    policy = ExpectedSpeedupDraftLength(costs, start=cfg.num_draft_tokens, max_len=cfg.max_draft_tokens)
    for asked in drafter.lengths[:-2]:  # the last steps are cut to the tokens left to emit
        assert asked == policy.k
        policy.observe(asked, asked)


def test_the_verify_curve_reads_noise_below_a_step_or_below_a_shorter_call_as_noise():
    from specpipe.engines import timing

    readings = {2: 9.0, 3: 12.5, 4: 12.0, 5: 14.0}  # ms of a call on n tokens; a one-token step takes 10 ms
    assert timing.curve_of(readings, 10.0) == (1.0, 1.25, 1.25, 1.4)


def test_calls_of_each_size_are_timed_in_turns_from_the_same_context(monkeypatch):
    """calls_ms times every call size once per round, round after round (a drift of the machine then falls on every
    size alike), each on the same context_len-token cache, and leaves the warm-up round out of the medians."""
    from specpipe.engines import timing

    calls, clock = [], iter(range(10_000))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))

    class Sequence:
        length = 0

        def append(self, ids):
            calls.append((self.length, len(ids)))
            self.length += len(ids)

        def truncate(self, n):
            self.length = n

    engine = type("Engine", (), {"vocab_size": 50, "new_sequence": lambda self: Sequence()})()
    ms = timing.calls_ms(engine, [1, 2, 9, 2], context_len=8, repeats=3)
    assert calls == [(0, 8)] + [(8, n) for _ in range(4) for n in (1, 2, 9)]
    assert ms == {1: 1e3, 2: 1e3, 9: 1e3}  # one fake second each call; warm-up round not counted
