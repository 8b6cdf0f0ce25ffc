"""Speculative decoding on real (tiny) ONNX Runtime engines: greedy equivalence and exact sampling."""

import numpy as np
import pytest
from scipy import stats

from specpipe.contract.generation import GenerationConfig, SamplingConfig
from specpipe.deployment import load_deployment
from specpipe.errors import UsageError
from specpipe.speculative import SpecStats, verify as verify_module
from specpipe.speculative.sampling import shape_probs
from specpipe.testing.greedy import assert_greedy_equivalent
from specpipe.triton.serving import ServedModel

PROMPTS = ["def add(a, b):", "The quick brown fox", "Héllo wörld 東京"]


@pytest.fixture(scope="module")
def pair(tiny_build):
    return load_deployment(tiny_build, threads=1)


@pytest.fixture(scope="module")
def self_pair(tiny_self_build):
    return load_deployment(tiny_self_build, threads=1)


def greedy(deployment, prompt, **overrides):
    cfg = GenerationConfig(max_new_tokens=48, stop_on_eos=False, draft_length="fixed", **overrides)
    return deployment.generator.generate(prompt, cfg)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_draft_equal_to_target_accepts_everything(self_pair, k):
    for prompt in PROMPTS:
        spec = greedy(self_pair, prompt, num_draft_tokens=k)
        base = greedy(self_pair, prompt, speculative=False)
        divergence = assert_greedy_equivalent(self_pair, prompt, spec.token_ids, base.token_ids)
        if divergence is None:
            assert spec.text == base.text
            assert spec.stats.acceptance_rate == 1.0
        assert base.stats.drafted == 0 and base.stats.mean_accepted_len == 1.0


def test_every_verify_call_after_the_prompts_is_timed_by_the_tokens_it_added(pair):
    # SpecStats.call_s feeds the build's verify curve: the prompt's call is not a step's, each later call adds the
    # last context token and that step's drafts
    spec = greedy(pair, PROMPTS[0], num_draft_tokens=3).stats
    base = greedy(pair, PROMPTS[0], speculative=False).stats
    for stats in (spec, base):
        assert sum(len(seconds) for seconds in stats.call_s.values()) == stats.steps - 1
        assert all(s > 0 for seconds in stats.call_s.values() for s in seconds)
    assert set(base.call_s) == {1}
    assert set(spec.call_s) <= {1, 2, 3, 4} and 4 in spec.call_s
    first_drafts = 3  # the first step drafted 3 on top of the prompt's call
    assert sum((n - 1) * len(seconds) for n, seconds in spec.call_s.items()) == spec.drafted - first_drafts
    summary = spec.as_dict()["target_calls"]
    assert {int(n): calls for n, (calls, _) in summary.items()} == {n: len(s) for n, s in spec.call_s.items()}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_unrelated_draft_is_still_identical_to_target_only(pair, k):
    rates = []
    for prompt in PROMPTS:
        spec = greedy(pair, prompt, num_draft_tokens=k)
        base = greedy(pair, prompt, speculative=False)
        assert_greedy_equivalent(pair, prompt, spec.token_ids, base.token_ids)
        rates.append(spec.stats.acceptance_rate)
    assert np.mean(rates) < 0.5  # an unrelated random draft is rarely right


def test_equivalence_rule_catches_a_planted_wrong_greedy_rule(pair, monkeypatch):
    """Accepting every draft emits the unrelated draft's tokens: the shared rule must call that a real
    mismatch, not a near-tie."""

    def accept_all(draft_tokens, target_logits):
        return verify_module.Verdict(len(draft_tokens), int(np.asarray(target_logits)[-1].argmax()))

    monkeypatch.setattr("specpipe.speculative.verify.verify_greedy", accept_all)  # judge() looks it up there
    spec = greedy(pair, PROMPTS[0], num_draft_tokens=3)
    base = greedy(pair, PROMPTS[0], speculative=False)
    with pytest.raises(AssertionError, match="beyond a near-tie"):
        assert_greedy_equivalent(pair, PROMPTS[0], spec.token_ids, base.token_ids)


def test_eos_and_max_tokens_stop(self_pair):
    eos = self_pair.generator.decoder.eos_token_ids
    result = greedy(self_pair, PROMPTS[0], num_draft_tokens=4)
    assert result.num_generated == 48 or result.token_ids[-1] in eos
    result = self_pair.generator.generate(PROMPTS[0], GenerationConfig(max_new_tokens=3, num_draft_tokens=5))
    assert result.num_generated <= 3


@pytest.mark.parametrize("speculative", [True, False])
def test_max_tokens_up_to_the_context_runs_and_one_more_is_refused(tiny_build, speculative):
    """prompt + max_new_tokens == max_seq_len runs to the last position; one more token is refused before any
    work, with the same message in-process and from the served model (one check behind both)."""
    deployment = load_deployment(tiny_build, threads=1)
    deployment.target.max_seq_len = 24  # a short context, so running to its end is quick
    prompt_ids = deployment.generator.encode(PROMPTS[0])
    room = 24 - len(prompt_ids)
    cfg = dict(stop_on_eos=False, speculative=speculative, num_draft_tokens=5, draft_length="fixed")
    result = deployment.generator.generate(prompt_ids, GenerationConfig(max_new_tokens=room, **cfg))
    assert result.num_generated == room and result.finish_reason == "length"

    message = f"prompt ({len(prompt_ids)} tokens) + max_tokens ({room + 1}) = 25 exceeds the engine's max_seq_len 24: " \
              f"at most {room} new tokens fit after this prompt"
    with pytest.raises(UsageError) as in_process:
        deployment.generator.start(prompt_ids, GenerationConfig(max_new_tokens=room + 1, **cfg))
    assert str(in_process.value) == message
    served = ServedModel(deployment).replies({"text_input": np.array([[PROMPTS[0].encode()]], dtype=np.object_),
                                              "max_tokens": np.array([[room + 1]], np.int32)})
    with pytest.raises(UsageError) as in_server:
        next(served)
    assert str(in_server.value) == message


def test_seeded_sampling_is_reproducible(pair):
    cfg = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=0.8, top_p=0.95), seed=7)
    a = pair.generator.generate(PROMPTS[1], cfg)
    b = pair.generator.generate(PROMPTS[1], cfg)
    assert a.token_ids == b.token_ids


# --- distribution: speculative sampling reproduces the target's probabilities exactly ---

NUM_SAMPLES = 20_000
CONTEXT = [5, 17, 42, 99, 7]


def chi_square_pvalue(observed: dict[int, int], probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Goodness of fit of token counts to `probs`; bins with expected count < min_expected are pooled."""
    total = sum(observed.values())
    expected = probs * total
    big = np.flatnonzero(expected >= min_expected)
    obs = np.array([observed.get(int(t), 0) for t in big], dtype=float)
    exp = expected[big]
    rest_obs, rest_exp = total - obs.sum(), total - exp.sum()
    if rest_exp > 0:
        obs, exp = np.append(obs, rest_obs), np.append(exp, rest_exp)
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def first_two_tokens(steps) -> tuple[int, int]:
    """The first two tokens a decode stream emits (one step may emit both); closes the stream."""
    emitted = next(steps)
    if len(emitted) < 2:
        emitted += next(steps)
    steps.close()
    return emitted[0], emitted[1]


def sample_first_two(deployment, cfg, n):
    decoder = deployment.generator.decoder
    return [first_two_tokens(decoder.decode(CONTEXT, cfg.model_copy(update={"seed": seed}), SpecStats()))
            for seed in range(n)]


def target_probs(deployment, context, sampling):
    logits = deployment.target.new_sequence().append(context)[-1]
    return shape_probs(logits, sampling)[0]


def first_and_second_pvalues(deployment, cfg):
    pairs = sample_first_two(deployment, cfg, NUM_SAMPLES)
    firsts = [a for a, _ in pairs]
    p_first = chi_square_pvalue(dict(zip(*np.unique(firsts, return_counts=True))), target_probs(deployment, CONTEXT, cfg.sampling))
    top_first = max(set(firsts), key=firsts.count)
    seconds = [b for a, b in pairs if a == top_first]
    p_second = chi_square_pvalue(
        dict(zip(*np.unique(seconds, return_counts=True))), target_probs(deployment, CONTEXT + [top_first], cfg.sampling)
    )
    return p_first, p_second, len(seconds)


# max_new_tokens=3 leaves room for a whole 2-token draft, so the second token is reached through a second
# accepted draft, a recovered token, or the bonus token; only the first two tokens are tested.
SAMPLED = GenerationConfig(max_new_tokens=3, num_draft_tokens=2, draft_length="fixed", stop_on_eos=False,
                           sampling=SamplingConfig(temperature=1.0))


def test_sampling_matches_target_distribution(pair):
    p_first, p_second, n_second = first_and_second_pvalues(pair, SAMPLED)
    assert n_second > 1000
    assert p_first > 0.001 and p_second > 0.001


def test_chi_square_catches_a_planted_wrong_rule(pair, monkeypatch):
    """Always accepting the draft emits the draft's distribution: the same test must reject it."""

    def always_accept(draft_tokens, q, p, rng):
        return verify_module.Verdict(len(draft_tokens), verify_module.sample(p[len(draft_tokens)], rng))

    monkeypatch.setattr("specpipe.speculative.verify.verify_sampled", always_accept)
    p_first, p_second, _ = first_and_second_pvalues(pair, SAMPLED)
    assert p_first < 0.001


def test_streamed_text_is_the_tokenizers_decode_of_every_token(tiny_tokenizer):
    """Token by token through the incremental detokenizer (multi-byte characters split across tokens, special
    tokens in between) gives transformers' decode of all of them (here through the Rust tokenizer's decode)."""
    from specpipe.speculative.generator import IncrementalDetokenizer

    ids = tiny_tokenizer("Héllo wörld 東京 ok , done .")["input_ids"]
    ids = ids[:5] + [tiny_tokenizer.eos_token_id] + ids[5:] + [tiny_tokenizer.all_special_ids[0]]
    detokenizer = IncrementalDetokenizer(tiny_tokenizer)
    text = "".join(detokenizer.add([t]) for t in ids) + detokenizer.flush()
    assert text == tiny_tokenizer.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(tiny_tokenizer):
    import copy

    from specpipe.speculative.generator import _text_of

    tokenizer = copy.copy(tiny_tokenizer)
    tokenizer.clean_up_tokenization_spaces = True
    ids = tokenizer("ok , done .")["input_ids"]
    assert _text_of(tokenizer)(ids) == tokenizer.decode(ids, skip_special_tokens=True) == "ok, done."


def test_planted_detokenizer_that_keeps_special_tokens_fails(tiny_tokenizer, monkeypatch):
    import specpipe.speculative.generator as generator

    monkeypatch.setattr(generator, "_text_of", lambda tok: lambda ids: tok.backend_tokenizer.decode(ids, skip_special_tokens=False))
    ids = tiny_tokenizer("ok done")["input_ids"] + [tiny_tokenizer.eos_token_id]
    detokenizer = generator.IncrementalDetokenizer(tiny_tokenizer)
    text = "".join(detokenizer.add([t]) for t in ids) + detokenizer.flush()
    assert text != tiny_tokenizer.decode(ids, skip_special_tokens=True)
