"""Prompt lookup (n-gram) drafting: the proposer on hand-written sequences, its incremental index against a
brute-force rescan, greedy equivalence and the exact distribution through the decoder (point-mass drafts)."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from specpipe.contract.drafts import NgramConfig
from specpipe.contract.generation import GenerationConfig, SamplingConfig
from specpipe.speculative.decoder import SpeculativeDecoder
from specpipe.speculative.ngram import NgramDrafter, copy_ceiling
from specpipe.speculative.stats import SpecStats
from specpipe.speculative.verify import Verdict
from specpipe.testing.distribution import chi_square_p, first_two_tokens
from specpipe.testing.engines import BigramEngine
from specpipe.testing.greedy import assert_greedy_equivalent

GREEDY = SamplingConfig()
RNG = np.random.default_rng(0)


def propose(context, k=4, ngram_max=3, ngram_min=1):
    return NgramDrafter(ngram_max=ngram_max, ngram_min=ngram_min).new_request().propose(context, k, GREEDY, RNG)


# ---- the copy ceiling (bench's bound for any prompt-lookup drafter) ----


@pytest.mark.parametrize(
    "prompt, output, expected",
    [
        ([5, 6, 7], [5, 6, 7, 9], 2.0),  # 7 never occurred before: emit 5; after 5 copy [6, 7] and add 9
        ([1, 2], [3, 4, 5], 1.0),  # nothing to copy: one token per call
        ([1], [1, 1, 1, 1], 2.0),  # emit 1; then the copy runs into the text it is copying (a repetition)
        # emit 8; after 8 copy [4, 5] + 9; after 9 copy [1, 2, 3]: 7 tokens in 3 calls
        ([9, 1, 2, 3, 8, 4, 5], [8, 4, 5, 9, 1, 2, 3], 7 / 3),
    ],
)
def test_copy_ceiling_on_hand_written_sequences(prompt, output, expected):
    assert copy_ceiling(prompt, output) == expected


def _lookup_tokens_per_call(prompt, output, k, ngram_max):
    """Tokens per target call of NgramDrafter when the target's greedy answer is `output`."""
    session, context, calls = NgramDrafter(ngram_max=ngram_max).new_request(), list(prompt), 0
    while len(context) < len(prompt) + len(output):
        future = output[len(context) - len(prompt):]
        draft = session.propose(context, k, GREEDY, RNG).tokens
        accepted = next((i for i, (d, t) in enumerate(zip(draft, future)) if d != t), min(len(draft), len(future)))
        context += future[: accepted + 1]
        calls += 1
    return len(output) / calls


def test_no_lookup_drafter_beats_the_copy_ceiling():
    rng = np.random.default_rng(3)
    for _ in range(40):
        prompt = list(rng.integers(0, 6, size=30))
        # Answers that partly copy spans of the prompt, partly write new tokens.
        output = []
        while len(output) < 40:
            start = int(rng.integers(0, 25))
            output += prompt[start : start + int(rng.integers(1, 8))] + list(rng.integers(0, 6, size=int(rng.integers(0, 3))))
        ceiling = copy_ceiling(prompt, output)
        for k in (1, 4, 16):
            for ngram_max in (1, 3):
                assert _lookup_tokens_per_call(prompt, output, k, ngram_max) <= ceiling + 1e-9


# ---- the proposer on hand-written sequences ----


def test_match_proposes_what_followed():
    proposal = propose([5, 6, 7, 8, 9, 5, 6], k=3)
    assert proposal.tokens == [7, 8, 9]
    assert proposal.probs is None  # point masses


def test_no_match_proposes_nothing():
    proposal = propose([1, 2, 3, 4, 5], k=4)
    assert proposal.tokens == [] and proposal.probs is None


def test_single_token_context_proposes_nothing():
    assert propose([7], k=4).tokens == []


def test_longest_match_wins():
    # (1, 2) last occurred at 0 -> 9 follows; the unigram (2,) last occurred at 4 -> 8 follows.
    context = [1, 2, 9, 3, 2, 8, 1, 2]
    assert propose(context, k=1).tokens == [9]
    assert propose(context, k=1, ngram_max=1).tokens == [8]


def test_most_recent_occurrence_wins():
    assert propose([1, 2, 3, 0, 1, 2, 4, 0, 1, 2], k=2).tokens == [4, 0]


def test_overlapping_match_keeps_copying_the_repetition():
    # Last 3-gram (1, 2, 1) matched at 0, overlapping itself: context[3:] = [2, 1], then the copy goes on.
    assert propose([1, 2, 1, 2, 1], k=4).tokens == [2, 1, 2, 1]
    assert propose([7, 7, 7], k=5).tokens == [7, 7, 7, 7, 7]


def test_proposal_truncated_at_k():
    context = [3, 4, 10, 11, 12, 13, 14, 15, 3, 4]
    assert propose(context, k=2).tokens == [10, 11]
    assert propose(context, k=6).tokens == [10, 11, 12, 13, 14, 15]


def test_ngram_min_refuses_shorter_matches():
    context = [1, 9, 2, 3, 1]  # only the unigram (1,) matches
    assert propose(context, k=2, ngram_min=1).tokens == [9, 2]
    assert propose(context, k=2, ngram_min=2).tokens == []


def _brute_force(context, k, ngram_max, ngram_min):
    """The rule, by rescanning the whole context: most recent earlier occurrence, longest n first."""
    for n in range(min(ngram_max, len(context) - 1), ngram_min - 1, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                out = []
                for i in range(k):
                    src = start + n + i
                    out.append(context[src] if src < len(context) else out[src - len(context)])
                return out
    return []


def test_incremental_index_equals_a_rescan_as_the_context_grows():
    rng = np.random.default_rng(1)
    for trial in range(20):
        context = list(rng.integers(0, 6, size=5))
        session = NgramDrafter(ngram_max=3, ngram_min=1).new_request()
        for _ in range(60):
            k = int(rng.integers(1, 7))
            assert session.propose(context, k, GREEDY, RNG).tokens == _brute_force(context, k, 3, 1)
            context = context + list(rng.integers(0, 6, size=int(rng.integers(1, 4))))


def test_a_context_that_is_not_an_extension_rebuilds_the_index():
    session = NgramDrafter(ngram_max=2, ngram_min=1).new_request()
    assert session.propose([1, 2, 3, 1], 2, GREEDY, RNG).tokens == [2, 3]
    # Rolled back and changed: the stale (1,) -> 1 must not be used.
    assert session.propose([4, 5, 4], 2, GREEDY, RNG).tokens == [5, 4]
    assert session.propose([4, 5], 2, GREEDY, RNG).tokens == []


# ---- bad input ----


@pytest.mark.parametrize("kwargs", [{"ngram_min": 0}, {"ngram_max": 0}, {"ngram_min": 4, "ngram_max": 3}])
def test_bad_ngram_sizes_are_refused(kwargs):
    with pytest.raises(ValidationError):
        NgramConfig(**kwargs)
    with pytest.raises(ValidationError):
        NgramDrafter(**kwargs)


def test_ngram_min_above_max_message_names_both():
    with pytest.raises(ValidationError, match="ngram_min 4 > ngram_max 3"):
        NgramConfig(ngram_min=4, ngram_max=3)


# ---- through the decoder ----


def _greedy_ids(decoder, prompt, **cfg):
    stats = SpecStats()
    ids = [t for step in decoder.decode(prompt, GenerationConfig(**cfg), stats) for t in step]
    return ids, stats


@pytest.mark.parametrize("draft_cfg", [{"draft_length": "fixed", "num_draft_tokens": k} for k in (1, 3, 5)]
                         + [{"draft_length": "adaptive"}])
def test_greedy_equivalence_with_ngram_drafts(draft_cfg):
    target = BigramEngine.random(32, seed=3, scale=1.5)
    prompt = list(np.random.default_rng(4).integers(0, 32, size=40))
    baseline, _ = _greedy_ids(SpeculativeDecoder(target, None), prompt, max_new_tokens=100)
    spec, stats = _greedy_ids(SpeculativeDecoder(target, NgramDrafter()), prompt, max_new_tokens=100, **draft_cfg)
    assert spec == baseline
    # Greedy bigram text falls into a cycle, so lookup must have drafted and been accepted.
    assert stats.accepted > 0 and stats.steps < len(baseline)


def test_no_match_costs_nothing():
    # Greedy walks 0 -> 1 -> 2 -> ...: no token repeats, so prompt lookup never finds a match.
    vocab = 64
    table = np.full((vocab, vocab), -5.0)
    table[np.arange(vocab), (np.arange(vocab) + 1) % vocab] = 5.0
    spec_engine, base_engine = BigramEngine(table), BigramEngine(table)
    spec, stats = _greedy_ids(SpeculativeDecoder(spec_engine, NgramDrafter()), [0], max_new_tokens=50)
    base, _ = _greedy_ids(SpeculativeDecoder(base_engine, None), [0], max_new_tokens=50)
    assert spec == base == list(range(1, 51))
    assert stats.drafted == 0
    assert (spec_engine.calls, spec_engine.tokens_run) == (base_engine.calls, base_engine.tokens_run)


# ---- the exact distribution with point-mass drafts ----

# A 5-token bigram target with hand-set p at temperature 1. The context [0, 1, 2, 0] makes lookup draft
# [1, 2] (what followed the earlier 0): x_1 = 1 is accepted about half the time, x_2 = 2 a third of it.
P_TABLE = np.array(
    [
        [0.05, 0.50, 0.20, 0.15, 0.10],  # after 0
        [0.10, 0.05, 0.35, 0.30, 0.20],  # after 1
        [0.40, 0.10, 0.10, 0.20, 0.20],  # after 2
        [0.20, 0.20, 0.20, 0.20, 0.20],  # after 3
        [0.30, 0.30, 0.10, 0.10, 0.20],  # after 4
    ]
)
CONTEXT = [0, 1, 2, 0]
RUNS = 20_000
SAMPLED = GenerationConfig(sampling=SamplingConfig(temperature=1.0), num_draft_tokens=2)


def _distribution_p_values(samples: np.ndarray, target: BigramEngine) -> list[float]:
    """p-values for the first token, and for the second given the first for every first token seen often."""
    vocab = target.vocab_size
    first, second = samples[:, 0], samples[:, 1]
    p_values = [chi_square_p(np.bincount(first, minlength=vocab), target.probs(CONTEXT[-1]))]
    for token in range(vocab):
        given = second[first == token]
        if len(given) >= 1000:
            p_values.append(chi_square_p(np.bincount(given, minlength=vocab), target.probs(token)))
    return p_values


def _point_mass_residual_kept(draft_tokens, q, p, rng):
    """Planted bug: on rejection, resample from p itself instead of norm(max(0, p - q)) (forgets the point mass)."""
    from specpipe.speculative.sampling import sample

    for i, x in enumerate(draft_tokens):
        if rng.random() >= p[i, x]:
            return Verdict(i, sample(p[i], rng))
    return Verdict(len(draft_tokens), sample(p[len(draft_tokens)], rng))


def _always_accept(draft_tokens, q, p, rng):
    """Planted bug: every draft is accepted."""
    from specpipe.speculative.sampling import sample

    return Verdict(len(draft_tokens), sample(p[len(draft_tokens)], rng))


@pytest.fixture(scope="module")
def bigram_target():
    return BigramEngine(np.log(P_TABLE))


def test_point_mass_drafts_emit_the_target_distribution(bigram_target):
    decoder = SpeculativeDecoder(bigram_target, NgramDrafter())
    samples = first_two_tokens(decoder, CONTEXT, SAMPLED, RUNS)
    assert np.mean(samples[:, 0] == 1) > 0.4  # the draft was tested, and mostly accepted at x_1
    p_values = _distribution_p_values(samples, bigram_target)
    assert len(p_values) >= 4, "first token, and second given at least three different first tokens"
    assert min(p_values) > 1e-3, p_values


@pytest.mark.parametrize("wrong_rule", [_point_mass_residual_kept, _always_accept])
def test_the_distribution_test_catches_a_planted_wrong_rule(bigram_target, monkeypatch, wrong_rule):
    monkeypatch.setattr("specpipe.speculative.verify.verify_sampled", wrong_rule)
    decoder = SpeculativeDecoder(bigram_target, NgramDrafter())
    samples = first_two_tokens(decoder, CONTEXT, SAMPLED, RUNS)
    assert min(_distribution_p_values(samples, bigram_target)) < 1e-3


# ---- on real (tiny) ONNX Runtime engines ----


def test_greedy_equivalence_on_tiny_onnx_engines(tiny_build):
    from specpipe.deployment import load_deployment
    from specpipe.speculative.generator import SpecGenerator

    deployment = load_deployment(tiny_build, threads=1)
    lookup = SpecGenerator(deployment.target, NgramDrafter(), deployment.tokenizer, deployment.manifest.eos_token_ids)
    drafted = 0
    for prompt in ["def add(a, b):\n    return a + b\n\ndef add(", "The quick brown fox. The quick brown", "Héllo wörld"]:
        base = deployment.generator.generate(prompt, GenerationConfig(max_new_tokens=48, speculative=False, stop_on_eos=False))
        for draft_cfg in [{"draft_length": "fixed", "num_draft_tokens": 1}, {"draft_length": "fixed", "num_draft_tokens": 5},
                          {}]:
            spec = lookup.generate(prompt, GenerationConfig(max_new_tokens=48, stop_on_eos=False, **draft_cfg))
            if assert_greedy_equivalent(deployment, prompt, spec.token_ids, base.token_ids) is None:  # a near-tie may flip between kernels (verify vs decode) on another CPU: not a bug
                assert spec.text == base.text
            drafted += spec.stats.drafted
    assert drafted > 0
