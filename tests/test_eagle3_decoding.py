"""Decoding with an EAGLE-3 head (speculative/eagle3.py, engines/eagle3_head.py): lossless, and the features matter.

A trained head on a random tiny target would take minutes to reach any acceptance, so the target here is built
to be predictable and the head is written by hand to predict it:

- the target (6 layers, builder graph with features after layers 1, 2, 4) has every layer's o_proj and down_proj
  zeroed, so its residual stream is the token's embedding E[t] all the way up, and its head rows are
  lm_head[v] = BETA * E[perm^-1(v)] / |E[perm^-1(v)]|: the next token is perm(t) with probability ~0.85 at T = 1
  (logit 8 * BETA against ~N(0, BETA^2) elsewhere), a Markov chain;
- the head's fc copies the first feature block (f_i = E[t_i]), its attention and MLP write nothing (o_proj and
  down_proj zero), and its lm_head row for draft token v is BETA * E[perm^-2(v)] / |.|: from f_i it predicts
  t_{i+2} = perm(perm(t_i)), which is the target's greedy choice, when that token is in its draft vocabulary
  (3/4 of the tokens). A later draft step reads the same state and drafts the same token again, which the
  target rejects: steps mix acceptance and rejection.

So the head is right only if the feature it gets for row i is f_i: a feature off by one position predicts
t_{i+1} instead. A wrong d2t drafts the wrong tokens. Both are planted below and must drop acceptance.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specpipe.contract.generation import GenerationConfig, SamplingConfig
from specpipe.speculative.decoder import SpeculativeDecoder
from specpipe.speculative.eagle3 import Eagle3Drafter, Eagle3DraftSession
from specpipe.speculative.equivalence import compare_greedy, near_tie_tolerance
from specpipe.speculative.sampling import shape_probs
from specpipe.speculative.stats import SpecStats
from specpipe.testing.distribution import chi_square_p
from tests.test_batching import batch_outputs

BETA = 1.0
LAYERS = (1, 2, 4)
PROMPTS = [[5, 17, 42, 99, 7], [200, 13], list(range(30, 60))]


def _unit(rows: torch.Tensor) -> torch.Tensor:
    return rows / rows.norm(dim=-1, keepdim=True)


@pytest.fixture(scope="module")
def markov(tmp_path_factory, tiny_tokenizer):
    """(target folder, engine folder, perm, regular token ids): the Markov target of the module docstring."""
    from transformers import AutoModelForCausalLM

    from specpipe.checkpoint import inspect_checkpoint
    from specpipe.engines.onnxruntime import write_engine_meta
    from specpipe.engines.shared_kv import KV_LAYOUT
    from specpipe.export.ortgenai_builder import run_model_builder
    from specpipe.testing.tiny import make_tiny_llama

    work = tmp_path_factory.mktemp("markov")
    ckpt = make_tiny_llama(work / "ckpt", seed=4, num_layers=6, tokenizer=tiny_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    vocab = model.config.vocab_size
    special = set(tiny_tokenizer.all_special_ids)
    regular = torch.tensor([t for t in range(vocab) if t not in special])
    generator = torch.Generator().manual_seed(0)
    perm = torch.arange(vocab)
    perm[regular] = regular[torch.randperm(len(regular), generator=generator)]  # specials map to themselves
    inverse = torch.argsort(perm)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embedding = model.get_input_embeddings().weight
        head = torch.zeros_like(model.lm_head.weight)
        head[regular] = BETA * _unit(embedding[inverse[regular]])  # logit of v peaks where t = perm^-1(v)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(ckpt, safe_serialization=True)
    out = run_model_builder(ckpt, work / "engine", "fp32", work / "cache", feature_layers=LAYERS)
    info = inspect_checkpoint(ckpt)
    write_engine_meta(out, vocab_size=info.vocab_size, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
                      head_dim=info.head_dim, max_seq_len=512, quant="none", kv_layout=KV_LAYOUT,
                      feature_layers=list(LAYERS))
    return SimpleNamespace(ckpt=ckpt, engine=out, perm=perm, inverse=inverse, regular=regular, model=model)


def write_markov_head(markov, folder: Path, *, d2t_shift: int = 0) -> Path:
    """The hand-made head of the module docstring, in upstream's format. `d2t_shift`: a planted wrong d2t."""
    from specpipe.checkpoint.eagle3 import head_config, write_eagle3_head

    config = markov.model.config
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    generator = torch.Generator().manual_seed(1)
    keep = torch.randperm(len(markov.regular), generator=generator)[: 3 * len(markov.regular) // 4]
    draft_ids = torch.sort(markov.regular[keep]).values  # the draft vocabulary: 3/4 of the regular tokens
    embedding = markov.model.get_input_embeddings().weight.detach()
    two_back = markov.inverse[markov.inverse[draft_ids]]  # perm^-2(v)

    def rand(*shape):
        return torch.randn(*shape, generator=generator) * 0.1

    tensors = {
        "fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, 2 * hidden)], 1),  # f_i's first block
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": torch.zeros(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": torch.zeros(hidden, inter),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": BETA * _unit(embedding[two_back]),
        "d2t": draft_ids - torch.arange(len(draft_ids)) + d2t_shift,
        "t2d": torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, True),
    }
    shape = SimpleNamespace(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=config.rms_norm_eps,
                            rope_theta=config.rope_theta, max_position_embeddings=512, vocab_size=config.vocab_size,
                            draft_vocab_size=len(draft_ids), feature_layers=LAYERS)
    return write_eagle3_head(folder, tensors, head_config(shape))


@pytest.fixture(scope="module")
def target(markov):
    from specpipe.engines.shared_kv import SharedKVEngine

    return SharedKVEngine(markov.engine, threads=1)


def drafter_for(markov, target, head_folder: Path, session_class=Eagle3DraftSession, dtype="float32") -> Eagle3Drafter:
    from specpipe.drafts.eagle3 import open_head
    from specpipe.engines.eagle3_head import check_pairing, target_embedding

    head = open_head(head_folder, target_embedding(markov.engine), dtype=dtype)
    check_pairing(head, target.feature_layers, target.vocab_size)
    drafter = Eagle3Drafter(head, target.vocab_size)
    if session_class is not Eagle3DraftSession:
        drafter.new_request = lambda cfg=None: session_class(drafter, cfg or GenerationConfig())
    return drafter


@pytest.fixture(scope="module")
def good(markov, target, tmp_path_factory):
    return drafter_for(markov, target, write_markov_head(markov, tmp_path_factory.mktemp("head") / "good"))


def greedy(decoder, prompt, k, **overrides):
    cfg = GenerationConfig(max_new_tokens=48, stop_on_eos=False, draft_length="fixed", num_draft_tokens=k, **overrides)
    stats = SpecStats()
    return sum(decoder.decode(prompt, cfg, stats), []), stats


def acceptance(target, drafter, k=1) -> float:
    decoder = SpeculativeDecoder(target, drafter)
    stats = [greedy(decoder, prompt, k)[1] for prompt in PROMPTS]
    return sum(s.accepted for s in stats) / sum(s.drafted for s in stats)


def test_head_engine_reads_the_target_embedding_and_layers(markov, target, good):
    head = good.head
    assert head.feature_layers == LAYERS == target.feature_layers
    assert np.array_equal(head.embedding_array, markov.model.get_input_embeddings().weight.detach().numpy())
    assert np.all(np.diff(head.token_ids) > 0)  # d2t's offset form gives sorted target ids


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_output_is_the_target_alone(target, good, k):
    """Identical to target-only decoding (the project's near-tie rule), with drafts both accepted and rejected."""
    decoder, alone = SpeculativeDecoder(target, good), SpeculativeDecoder(target, None)
    for prompt in PROMPTS:
        spec, stats = greedy(decoder, prompt, k)
        base, base_stats = greedy(alone, prompt, k, speculative=False)
        divergence = compare_greedy(target, prompt, spec, base, near_tie_tolerance("none"))
        assert divergence is None or divergence.near_tie, divergence
        assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted
        assert base_stats.drafted == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "ort-float32", "ort-int8"])
def test_a_bf16_or_int8_head_computes_nearly_the_same_and_stays_lossless(markov, target, good, dtype):
    """dtype bfloat16 (matrices in bf16), int8 (torch's dynamically quantized Linear: int8 weights per channel,
    activations per tensor), or the same head in ONNX Runtime (fp32; int8 as MatMulNBits): logits within a few
    percent of torch fp32's; decoding is exact either way."""
    other = drafter_for(markov, target, good.head.folder, dtype=dtype)
    assert other.head.dtype == dtype
    rows = np.random.default_rng(0).standard_normal((5, good.head.feature_width)).astype(np.float32)
    (full, _), (half, _) = (d.head.context_rows(d.head.new_cache(), [5, 6, 7, 8, 9], rows) for d in (good, other))
    assert np.abs(full - half).max() <= 0.05 * np.abs(full).max()
    decoder, alone = SpeculativeDecoder(target, other), SpeculativeDecoder(target, None)
    for prompt in PROMPTS:
        spec, _ = greedy(decoder, prompt, 3)
        base, _ = greedy(alone, prompt, 3, speculative=False)
        divergence = compare_greedy(target, prompt, spec, base, near_tie_tolerance("none"))
        assert divergence is None or divergence.near_tie, divergence
    assert acceptance(target, other) > 0.6


def test_the_head_dtype_is_the_fastest_timed(markov, good, monkeypatch):
    """fastest_head_dtype times every dtype torch runs here and keeps the least median (timings replaced by a
    fixed table: which dtype is fastest is the machine's business, the choice rule is ours)."""
    from specpipe.engines import eagle3_head
    from specpipe.drafts.eagle3 import fastest_head_dtype
    from specpipe.engines.eagle3_head import HEAD_DTYPES, target_embedding

    table = {"float32": 3.0, "bfloat16": 1.0, "int8": 2.0, "ort-float32": 1.5, "ort-int8": 1.2}
    monkeypatch.setattr("specpipe.engines.timing.head_step_ms", lambda head, **_: table[head.dtype])
    dtype, ms = fastest_head_dtype(good.head.folder, target_embedding(markov.engine), rounds=2)
    assert set(ms) == set(HEAD_DTYPES) and dtype == "bfloat16" and ms == table
    with pytest.raises(eagle3_head.EngineError, match="float16"):
        eagle3_head.head_dtype("float16")


def test_head_predicts_the_target(target, good):
    """The premise of the planted bugs below: with the right features and d2t, most first drafts are accepted."""
    assert acceptance(target, good, k=1) > 0.6


class OffByOneSession(Eagle3DraftSession):
    """Planted bug: row i gets the features of position i - 1 (an off-by-one between features and tokens)."""

    def observe_features(self, first_position, features):
        known = getattr(self, "known", {})
        known.update({first_position + j: row for j, row in enumerate(features)})
        self.known = known
        shifted = np.stack([known.get(first_position + j - 1, row) for j, row in enumerate(features)])
        super().observe_features(first_position, shifted)


def test_a_feature_off_by_one_position_drops_acceptance(markov, target, good):
    wrong = acceptance(target, drafter_for(markov, target, good.head.folder, OffByOneSession))
    assert wrong < 0.1 < 0.6 < acceptance(target, good)


def test_a_wrong_d2t_drops_acceptance(markov, target, good, tmp_path):
    shifted = drafter_for(markov, target, write_markov_head(markov, tmp_path / "shifted", d2t_shift=1))
    assert acceptance(target, shifted) < 0.1 < 0.6 < acceptance(target, good)


def test_the_first_step_is_the_prefill_and_features_cost_nothing_unasked(target, good):
    """Step 1 drafts nothing (no features yet); a target sequence computes features only after keep_features()."""
    decoder = SpeculativeDecoder(target, good)
    cfg = GenerationConfig(max_new_tokens=8, stop_on_eos=False, draft_length="fixed", num_draft_tokens=2)
    steps = decoder.decode(PROMPTS[0], cfg, SpecStats())
    assert len(next(steps)) == 1
    steps.close()
    plain = target.new_sequence()
    plain.append(PROMPTS[0])
    assert plain.features is None
    kept = target.new_sequence()
    kept.keep_features()
    kept.append(PROMPTS[0])
    assert kept.features.shape == (len(PROMPTS[0]), 3 * 64)


def test_seeded_sampling_is_reproducible(target, good):
    decoder = SpeculativeDecoder(target, good)
    cfg = GenerationConfig(max_new_tokens=32, stop_on_eos=False, num_draft_tokens=3, seed=11,
                           sampling=SamplingConfig(temperature=0.9, top_p=0.95))
    runs = [sum(decoder.decode(PROMPTS[0], cfg, SpecStats()), []) for _ in range(2)]
    assert runs[0] == runs[1]
    other = sum(decoder.decode(PROMPTS[0], cfg.model_copy(update={"seed": 12}), SpecStats()), [])
    assert other != runs[0]


# --- sampling: tokens 2 and 3 come from the step that drafted from the head (step 1 is the prefill) ---

CONTEXT = [5, 17, 42, 99, 7]
RUNS = 6000
SAMPLED = GenerationConfig(max_new_tokens=4, num_draft_tokens=2, draft_length="fixed", stop_on_eos=False,
                           sampling=SamplingConfig(temperature=1.0))


def first_three(decoder, seed: int, context=CONTEXT) -> list[int]:
    emitted: list[int] = []
    steps = decoder.decode(context, SAMPLED.model_copy(update={"seed": seed}), SpecStats())
    for tokens in steps:
        emitted += tokens
        if len(emitted) >= 3:
            break
    steps.close()
    return emitted[:3]


def second_and_third_pvalues(target, drafter, context=CONTEXT) -> tuple[float, float, int]:
    """p-values of token 2 given the commonest token 1, and of token 3 given the commonest (1, 2), against the
    target's exact probabilities."""
    decoder = SpeculativeDecoder(target, drafter)
    runs = np.array([first_three(decoder, seed, context) for seed in range(RUNS)])
    vocab = target.vocab_size

    def p_value(rows: np.ndarray, context: list[int]) -> float:
        probs = shape_probs(target.new_sequence().append(context)[-1], SAMPLED.sampling)[0]
        return chi_square_p(np.bincount(rows, minlength=vocab), probs)

    first = np.bincount(runs[:, 0]).argmax()
    given_first = runs[runs[:, 0] == first]
    second = np.bincount(given_first[:, 1]).argmax()
    given_two = given_first[given_first[:, 1] == second]
    return (p_value(given_first[:, 1], list(context) + [int(first)]),
            p_value(given_two[:, 2], list(context) + [int(first), int(second)]), len(given_two))


def test_sampling_keeps_the_target_distribution(target, good):
    p_second, p_third, n_third = second_and_third_pvalues(target, good)
    assert n_third > 2000
    assert p_second > 0.001 and p_third > 0.001


class MisplacedQSession(Eagle3DraftSession):
    """Planted bug: q is reported over draft-vocabulary indices instead of the target ids d2t maps them to (the
    token itself is drawn right), so the acceptance test divides p by the wrong q."""

    def pick(self, logits, sampling, rng):
        token, q = super().pick(logits, sampling, rng)
        if q is not None:
            wrong = np.zeros_like(q)
            wrong[: len(self.head.token_ids)] = q[self.head.token_ids]
            q = wrong
        return token, q


def test_chi_square_catches_a_misplaced_q(markov, target, good):
    p_second, p_third, _ = second_and_third_pvalues(target, drafter_for(markov, target, good.head.folder, MisplacedQSession))
    assert min(p_second, p_third) < 0.001


# --- prompt lookup drafts where the head is unsure (speculative/eagle3.py LOOKUP_BELOW) ---


def cycle_prompt(markov) -> list[int]:
    """x, perm(x), perm^2(x), perm^3(x), x, perm(x): after the target's greedy perm^2(x) the context's last two tokens
    occurred before, so prompt lookup copies perm^3(x) (the target's next: accepted) and then x (rejected)."""
    x = int(markov.regular[10])
    chain = [x]
    for _ in range(3):
        chain.append(int(markov.perm[chain[-1]]))
    return chain + chain[:2]


class RecordingSession(Eagle3DraftSession):
    def propose(self, context, k, sampling, rng):
        proposal = super().propose(context, k, sampling, rng)
        self.proposals = getattr(self, "proposals", []) + [(list(context), k, proposal.tokens, proposal.copied)]
        return proposal


def copied_steps(drafter) -> int:
    return sum(copied for session in drafter.sessions for *_, copied in getattr(session, "proposals", []))


def lookup_drafter(markov, target, good, below: float, session_class=RecordingSession) -> Eagle3Drafter:
    drafter = drafter_for(markov, target, good.head.folder, session_class)
    drafter.lookup_below = below
    sessions = []
    make = drafter.new_request
    drafter.new_request = lambda cfg=None: sessions.append(make(cfg)) or sessions[-1]
    drafter.sessions = sessions
    return drafter


def test_where_the_head_is_unsure_prompt_lookup_drafts_and_stays_lossless(markov, target, good):
    """Under the threshold (here 1.0: always) a step whose context has a match drafts the lookup's copy, at most
    LOOKUP_MAX_TOKENS of it; at 0 never. Greedy output is the target's either way."""
    from specpipe.speculative.eagle3 import LOOKUP_MAX_TOKENS
    from specpipe.speculative.ngram import NgramDrafter

    prompts = [cycle_prompt(markov)] + PROMPTS
    alone = SpeculativeDecoder(target, None)
    for below, k in [(1.0, 3), (1.0, 6), (0.0, 3)]:
        drafter = lookup_drafter(markov, target, good, below)
        copied = []
        for prompt in prompts:
            spec, stats = greedy(SpeculativeDecoder(target, drafter), prompt, k)
            base, _ = greedy(alone, prompt, k, speculative=False)
            divergence = compare_greedy(target, prompt, spec, base, near_tie_tolerance("none"))
            assert divergence is None or divergence.near_tie, divergence
            copied.append(stats)
        # the generation's counters (SpecStats.copied_*) count exactly the copied steps
        assert sum(s.copied_steps for s in copied) == copied_steps(drafter)
        assert all(s.copied_accepted <= s.copied_drafted <= s.drafted for s in copied)
        steps = [step for session in drafter.sessions for step in session.proposals]
        looked_up = [(context, asked, tokens) for context, asked, tokens, was_copied in steps if was_copied]
        if below == 0.0:
            assert not looked_up
            continue
        assert looked_up  # the cycle prompt's second step at least
        for context, asked, tokens in looked_up:
            copied = NgramDrafter().new_request().propose(context, min(asked, LOOKUP_MAX_TOKENS), SAMPLED.sampling,
                                                          np.random.default_rng(0))
            assert tokens == copied.tokens and len(tokens) <= LOOKUP_MAX_TOKENS
    first = drafter_for(markov, target, good.head.folder, RecordingSession)
    first.lookup_below = 1.0
    session = first.new_request(GenerationConfig())
    cycle = cycle_prompt(markov)
    greedy_next = int(markov.perm[cycle[-1]])
    row = target.new_sequence()
    row.keep_features()
    row.append(cycle)
    session.observe_features(0, row.features)
    proposal = session.propose(cycle + [greedy_next], 2, SAMPLED.sampling, np.random.default_rng(0))
    assert proposal.tokens == [int(markov.perm[greedy_next]), cycle[0]] and proposal.probs is None


def cycle_session(markov, target, good, policy=None):
    """A session with lookup_below 1.0 (the threshold never keeps the head) that has seen the cycle prompt's
    features; its context for `propose`: the prompt and the target's greedy next token (prompt lookup matches it)."""
    drafter = drafter_for(markov, target, good.head.folder)
    drafter.lookup_below = 1.0
    session = drafter.new_request(GenerationConfig(draft_length="adaptive"))
    if policy is not None:  # as a request under adaptive K sets them (settle.RequestState.start)
        session.worth_another, session.tokens_per_cost = policy.worth_another, policy.tokens_per_cost
    cycle = cycle_prompt(markov)
    row = target.new_sequence()
    row.keep_features()
    row.append(cycle)
    session.observe_features(0, row.features)
    return session, cycle + [int(markov.perm[cycle[-1]])]


def test_under_adaptive_k_a_copy_beats_the_head_only_where_the_request_learned_it_does(markov, target, good):
    """Under adaptive K (as deployed) a step copies only as many tokens as pay, and only where that copy's expected
    tokens per cost, from the request's own copies so far, beat the head's x_1 (speculative/eagle3.py CopyOdds)."""
    from specpipe.contract.costs import StepCosts
    from specpipe.speculative.adaptive import ExpectedSpeedupDraftLength
    from specpipe.speculative.eagle3 import LOOKUP_MAX_TOKENS
    from specpipe.speculative.ngram import NgramDrafter

    policy = ExpectedSpeedupDraftLength(StepCosts(draft=0.12, verify_per_token=0.13, verify=(1.02, 1.19, 1.30)), 1, 16)
    rng = np.random.default_rng(0)

    def propose(first: float, stay: float):
        session, context = cycle_session(markov, target, good, policy)
        session.copy_odds._first, session.copy_odds._stay = [first, 1.0], [stay, 1.0]
        return session, session.propose(context, 16, SAMPLED.sampling, rng), context

    session, proposal, context = propose(1.0, 0.9)  # copies always right so far: the whole match
    match = NgramDrafter().new_request().propose(context, LOOKUP_MAX_TOKENS, SAMPLED.sampling, rng).tokens
    assert len(match) == LOOKUP_MAX_TOKENS and match[0] == int(markov.perm[context[-1]])
    assert proposal.copied and proposal.tokens == match
    session.observe(4, 1)  # what the request learns from it
    assert session.copy_odds.first == 1.0 and session.copy_odds.stay < 0.9
    _, proposal, _ = propose(1.0, 0.1)  # copied runs seldom hold: one token
    assert proposal.copied and proposal.tokens == match[:1]
    session, proposal, _ = propose(0.0, 0.9)  # copies never right: the head drafts
    assert not proposal.copied and proposal.tokens and proposal.probs is not None
    session.observe(len(proposal.tokens), 0)  # a head draft's outcome is not a copy's
    assert session.copy_odds.first == 0.0
    # Without the cost rule (a fixed K) the threshold alone decides, and the copy runs to the match.
    session, context = cycle_session(markov, target, good)
    session.copy_odds._first = [0.0, 1.0]
    proposal = session.propose(context, 16, SAMPLED.sampling, rng)
    assert proposal.copied and proposal.tokens == match


def test_lookup_drafts_keep_the_target_distribution(markov, target, good):
    """Sampling with the lookup drafting every step it can: tokens 2 and 3 (the step the cycle prompt's copy
    drafts) follow the target's probabilities."""
    drafter = lookup_drafter(markov, target, good, 1.0)
    p_second, p_third, n_third = second_and_third_pvalues(target, drafter, cycle_prompt(markov))
    assert copied_steps(drafter) > RUNS / 2
    assert n_third > 1000 and p_second > 0.001 and p_third > 0.001


class CopiedWithHeadsQSession(Eagle3DraftSession):
    """Planted bug: a copied draft carries a sampled draft's q (here uniform over the vocabulary) instead of point
    masses, so the rule accepts a copied token with min(1, p / q) against the wrong q."""

    def propose(self, context, k, sampling, rng):
        proposal = super().propose(context, k, sampling, rng)
        if proposal.copied and not sampling.greedy:
            vocab = self.drafter.target_vocab_size
            proposal.probs = np.full((len(proposal.tokens), vocab), 1.0 / vocab)
        return proposal


def test_chi_square_catches_a_copied_draft_with_the_wrong_q(markov, target, good):
    drafter = lookup_drafter(markov, target, good, 1.0, CopiedWithHeadsQSession)
    p_second, p_third, _ = second_and_third_pvalues(target, drafter, cycle_prompt(markov))
    assert min(p_second, p_third) < 0.001


# --- the gate's memo engine (gate/memo.py) remembers features beside logits ---


def test_the_gates_memo_engine_gives_the_head_the_same_features(target, good):
    """The gate samples through an engine that remembers logits by prefix; a head drafting through it must see the
    features the target computes: the same drafts accepted, on the first pass (misses) and the second (hits)."""
    from specpipe.gate.memo import MemoEngine

    memo = MemoEngine(target)
    for prompt in PROMPTS[:2]:
        base, base_stats = greedy(SpeculativeDecoder(target, good), prompt, 2)
        for _ in range(2):
            spec, stats = greedy(SpeculativeDecoder(memo, good), prompt, 2)
            assert spec == base and (stats.drafted, stats.accepted) == (base_stats.drafted, base_stats.accepted)
    assert memo.hits > 0 and base_stats.accepted > 0


# --- generate / bench --draft HEAD on a built deployment ---


@pytest.fixture(scope="module")
def alone_build(tiny_target, tmp_path_factory):
    """A tiny target-alone build, and a copy whose target graph also outputs the features of layer 0 (the tiny
    target has 2 layers: layer 0's output is the only one that feeds another layer)."""
    import shutil

    from specpipe.builder import build
    from specpipe.builder.config import BuildConfig
    from specpipe.export.ortgenai_builder import run_model_builder

    engines = tmp_path_factory.mktemp("alone")
    plain = build(BuildConfig(target=str(tiny_target), draft="none", name="alone", engines_dir=engines, repo_dir=None))
    featured = shutil.copytree(plain, engines / "featured")
    run_model_builder(tiny_target, engines / "raw", "fp32", engines / "cache", feature_layers=(0,))
    for name in ("model.onnx", "model.onnx.data"):
        shutil.copy(engines / "raw" / name, featured / "target" / name)
    meta = json.loads((featured / "target" / "engine.json").read_text())
    (featured / "target" / "engine.json").write_text(json.dumps({**meta, "feature_layers": [0]}))
    return SimpleNamespace(plain=plain, featured=featured)


@pytest.fixture(scope="module")
def tiny_head(tiny_target, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from specpipe.checkpoint.eagle3 import head_config, write_eagle3_head
    from specpipe.distill.eagle3 import make_head

    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    head = make_head(model, feature_layers=(0,), draft_token_ids=torch.arange(0, model.config.vocab_size, 2),
                     warm_start=True, warm_attention=False, seed=0)
    return write_eagle3_head(tmp_path_factory.mktemp("tinyhead") / "head", head.state_dict(), head_config(head.shape))


def test_cli_generate_and_bench_decode_with_a_head(alone_build, tiny_head, tmp_path):
    from click.testing import CliRunner

    from specpipe.cli import cli

    runner = CliRunner()
    args = ["generate", str(alone_build.featured), "-p", "def add(a, b):", "--max-tokens", "24", "--json"]
    spec = runner.invoke(cli, args + ["--draft", str(tiny_head), "-k", "3"])
    base = runner.invoke(cli, args + ["--no-speculative"])
    assert spec.exit_code == 0 and base.exit_code == 0, spec.output + base.output
    spec_out, base_out = json.loads(spec.output), json.loads(base.output)
    assert spec_out["token_ids"] == base_out["token_ids"]
    assert spec_out["drafted"] > 0

    report = tmp_path / "bench.json"
    result = runner.invoke(cli, ["bench", str(alone_build.featured), "--draft", str(tiny_head), "-k", "1,2",
                                 "--max-prompts", "1", "--max-new-tokens", "12", "--no-peer", "--warmup-prompts", "0",
                                 "--json-out", str(report)])
    assert result.exit_code == 0, result.output
    rows = json.loads(report.read_text())["sets"][0]["rows"]
    speculative = [row for row in rows if row["kind"] == "speculative"]
    assert {row["strategy"] for row in speculative} == {"eagle3-head"} and len(speculative) == 3  # K=1, 2, adaptive
    assert all(row["matches_target"] == row["prompts"] for row in speculative), speculative
    by_position = {row["label"]: row["acceptance_by_position"] for row in speculative}
    assert len(by_position["K=2"]) == 2 and all(0 <= a <= 1 for a in by_position["K=2"])


def test_cli_refuses_a_head_the_target_has_no_features_for(alone_build, tiny_head, capsys):
    from specpipe.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(alone_build.plain), "-p", "hi", "--draft", str(tiny_head)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "outputs no features" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# --- the batching scheduler: rows' features come back from batched prefill, decode and verify calls ---

BATCH_CFGS = [
    GenerationConfig(max_new_tokens=30, stop_on_eos=False, draft_length="fixed", num_draft_tokens=3),
    GenerationConfig(max_new_tokens=25, stop_on_eos=False),  # adaptive: the planner decides
    GenerationConfig(max_new_tokens=40, stop_on_eos=False, speculative=False),
    GenerationConfig(max_new_tokens=20, stop_on_eos=False, draft_length="fixed", num_draft_tokens=1),
    GenerationConfig(max_new_tokens=30, stop_on_eos=False, draft_length="fixed", num_draft_tokens=2, seed=3,
                     sampling=SamplingConfig(temperature=0.9)),
]
BATCH_PROMPTS = [PROMPTS[0], list(range(60, 100)), [9, 8, 7], PROMPTS[1], list(range(120, 137))]


def batched_drafts_match_alone(target, drafter) -> bool:
    """Run BATCH_CFGS through a 3-slot scheduler; True when every fixed-K request drafted and accepted exactly what
    the single-request decoder does, and every output is the target's (asserted)."""
    from specpipe.speculative.batching import BatchScheduler

    scheduler = BatchScheduler(target, drafter, [], None, max_batch_size=3, max_queue=16, prefill_chunk=16)
    outputs, stats = batch_outputs(scheduler, BATCH_PROMPTS, BATCH_CFGS, stagger=True)  # each joins mid-flight
    decoder, alone = SpeculativeDecoder(target, drafter), SpeculativeDecoder(target, None)
    same = True
    for prompt, cfg, out, batched in zip(BATCH_PROMPTS, BATCH_CFGS, outputs, stats):
        assert out is not None and len(out) == cfg.max_new_tokens
        single = SpecStats()
        reference = sum(decoder.decode(prompt, cfg, single), [])
        if cfg.draft_length == "fixed":
            same = same and out == reference and (batched.drafted_at, batched.accepted_at) == (single.drafted_at,
                                                                                                single.accepted_at)
        if cfg.sampling.greedy:
            base = sum(alone.decode(prompt, cfg.model_copy(update={"speculative": False}), SpecStats()), [])
            divergence = compare_greedy(target, prompt, out, base, near_tie_tolerance("none"))
            assert divergence is None or divergence.near_tie, divergence
    # The head is good at a block's first position only (module docstring: ~3/4 of tokens are in its vocabulary;
    # later positions read its own hidden state). Count the fixed-K requests alone: whether the adaptive request
    # speculates at all is the planner's choice from measured step times, so its share varies with the machine's load
    # (CI saw 0.286 over all requests when it drafted 56 tokens, 0.34 when it drafted none).
    first = sum(s.accepted_at[0] for s, c in zip(stats, BATCH_CFGS) if c.draft_length == "fixed")
    drafted = sum(s.drafted_at[0] for s, c in zip(stats, BATCH_CFGS) if c.draft_length == "fixed")
    assert drafted > 0
    return same and first / drafted > 0.5


@pytest.mark.timing
def test_batched_requests_draft_and_decode_as_alone(target, good):
    """Requests that join a running batch (chunked prefill, batched decode rows, verify rows) draft from the same
    features as alone: fixed-K requests draft and accept exactly what the single-request decoder does, and
    every output equals the target's alone."""
    assert batched_drafts_match_alone(target, good)


def batched_features_match_alone(target) -> bool:
    """Rows that keep features get, from a batched prefill and a batched decode, the features each gets alone; a
    row that does not keep them gets none."""
    prompts, tokens = [PROMPTS[0], PROMPTS[2][:9], [3, 4]], [11, 12, 13]
    batch = target.new_batch(3)
    rows = [batch.new_sequence() for _ in prompts]
    rows[0].keep_features()
    rows[1].keep_features()
    batch.prefill(rows, prompts)
    prefilled = [row.features for row in rows]
    batch.decode(rows, tokens)
    decoded = [row.features for row in rows]
    assert prefilled[2] is None and decoded[2] is None
    same = True
    for i in range(2):
        alone = target.new_sequence()
        alone.keep_features()
        alone.append(prompts[i])
        same = same and prefilled[i].shape == alone.features.shape and np.allclose(prefilled[i], alone.features, atol=1e-4)
        alone.append([tokens[i]])
        same = same and decoded[i].shape == alone.features.shape and np.allclose(decoded[i], alone.features, atol=1e-4)
    return same


def test_batched_calls_give_each_row_its_features(target):
    assert batched_features_match_alone(target)


def test_planted_bug_rows_getting_each_others_features_fails(target, monkeypatch):
    real = type(target).run_with_features

    def swapped(self, buffers, input_ids, lengths, preempt=None, new_lengths=None, logits_at=None):
        logits, features = real(self, buffers, input_ids, lengths, preempt, new_lengths, logits_at)
        return logits, np.roll(features, 1, axis=0) if len(features) > 1 else features

    monkeypatch.setattr(type(target), "run_with_features", swapped)
    assert not batched_features_match_alone(target)
