"""A draft head sliced to its most frequent tokens (FR-Spec): the graph surgery is exact, the build records
it, proposals stay inside the kept tokens, and speculative decoding stays exact (greedy and sampled)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from specpipe.checkpoint.draft_vocab import FILE, choose_token_ids, count_tokens, read_ranking, write_ranking
from specpipe.errors import UsageError
from specpipe.testing.greedy import assert_greedy_equivalent
from tests.test_cli_core import run_cli
from tests.test_decoding import SAMPLED, first_and_second_pvalues

KEEP = 48


@pytest.fixture(scope="module")
def ranked_draft(tiny_target, tmp_path_factory) -> Path:
    """The tiny target's own weights as a draft, with a ranking that is not id order."""
    folder = tmp_path_factory.mktemp("ranked") / "draft"
    shutil.copytree(tiny_target, folder)
    counts = np.random.default_rng(0).integers(0, 50, size=320)
    counts[::3] = 0  # tokens the "training data" never used
    write_ranking(folder, counts, source="test")
    return folder


@pytest.fixture(scope="module")
def sliced_build(tiny_target, ranked_draft, tiny_engines_dir) -> Path:
    from specpipe.builder import build
    from specpipe.builder.config import BuildConfig

    return build(BuildConfig(target=str(tiny_target), draft=str(ranked_draft), name="sliced", draft_vocab=KEEP,
                             engines_dir=tiny_engines_dir, repo_dir=None))


def test_ranking_round_trips_most_frequent_first(tmp_path):
    class Seq:
        def __init__(self, ids, prompt_len):
            self.token_ids, self.prompt_len = np.array(ids), prompt_len

    counts = count_tokens([Seq([9, 9, 5, 7, 7, 7], 2), Seq([1, 2, 2], 0)], vocab_size=10)
    assert counts.tolist() == [0, 1, 2, 0, 0, 1, 0, 3, 0, 0]  # the prompt's 9, 9 are not counted
    write_ranking(tmp_path, counts, source="t")
    ranking = read_ranking(tmp_path)
    assert ranking["ranked_ids"] == [7, 2, 1, 5] and ranking["counts"] == [3, 2, 1, 1]

    chosen = choose_token_ids(tmp_path, 3, 10, always=[9])
    assert chosen["token_ids"].tolist() == [2, 7, 9]  # the eos id is kept whatever its rank
    assert chosen["coverage"] == pytest.approx(5 / 7, abs=1e-5)
    assert choose_token_ids(tmp_path, 6, 10)["token_ids"].tolist() == [0, 1, 2, 3, 5, 7]  # unseen fill by id
    assert choose_token_ids(tmp_path, 0, 10) is None and choose_token_ids(tmp_path, 10, 10) is None


def test_a_draft_without_ranking_keeps_its_vocabulary_unless_asked(tmp_path):
    assert choose_token_ids(tmp_path, None, 10) is None
    with pytest.raises(UsageError, match="--draft-vocab 5: .* has no draft-vocab.json"):
        choose_token_ids(tmp_path, 5, 10)


def test_sliced_engine_scores_exactly_the_kept_columns(sliced_build):
    from specpipe.engines import load_engine

    manifest = json.loads((sliced_build / "manifest.json").read_text())
    assert manifest["draft"]["vocab"]["size"] == KEEP and 0 < manifest["draft"]["vocab"]["coverage"] < 1
    assert manifest["draft"]["engine"]["graph"] == "genai"  # the builder's graph slices too: the draft still batches
    draft, target = load_engine(sliced_build / "draft"), load_engine(sliced_build / "target")
    ids = draft.token_ids
    assert draft.vocab_size == len(ids) == KEEP and list(ids) == sorted(set(ids.tolist()))
    assert set(manifest["eos_token_ids"]) <= set(ids.tolist())
    context = [5, 17, 42, 99, 7, 3]
    full = target.new_sequence().append(context)
    sliced = draft.new_sequence().append(context)
    np.testing.assert_allclose(sliced, full[:, ids], atol=1e-4)


def test_proposals_stay_inside_the_kept_tokens_and_greedy_output_is_the_targets(sliced_build):
    from specpipe.contract.generation import SamplingConfig
    from specpipe.deployment import load_deployment

    deployment = load_deployment(sliced_build)
    kept = set(deployment.drafter.engine.token_ids.tolist())
    session = deployment.drafter.new_request()
    rng = np.random.default_rng(0)
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0)):
        proposal = session.propose([5, 17, 42, 99], 6, sampling, rng)
        assert proposal.tokens and set(proposal.tokens) <= kept
        if not sampling.greedy:  # q is over the whole vocabulary, zero outside the kept tokens
            assert proposal.probs.shape[1] == 320 and proposal.probs[:, sorted(set(range(320)) - kept)].max() == 0

    prompt = deployment.generator.encode("def add(a, b):")
    cfg = deployment.generation_config(max_new_tokens=24, num_draft_tokens=4, draft_length="fixed")
    spec = deployment.generator.generate(prompt, cfg)
    alone = deployment.generator.generate(prompt, cfg.model_copy(update={"speculative": False}))
    assert_greedy_equivalent(deployment, prompt, spec.token_ids, alone.token_ids)

    # The draft is the target minus columns: its greedy guess is the target's token exactly when the
    # target chose a token the draft scores.
    for i, token in enumerate(alone.token_ids):
        guess = session.propose(prompt + alone.token_ids[:i], 1, SamplingConfig(), rng).tokens[0]
        assert (guess == token) == (token in kept)


def test_sampling_with_a_sliced_draft_matches_the_target_distribution(sliced_build):
    from specpipe.deployment import load_deployment

    p_first, p_second, n_second = first_and_second_pvalues(load_deployment(sliced_build), SAMPLED)
    assert n_second > 1000
    assert p_first > 0.001 and p_second > 0.001


def test_a_quantized_sliced_draft_measures_its_accuracy_on_the_kept_tokens(capsys, tiny_target, ranked_draft, tmp_path):
    code, out, err = run_cli(capsys, "build", "--target", str(tiny_target), "--draft", str(ranked_draft), "--draft-vocab",
                             str(KEEP), "--draft-quant", "int8-wo", "--accept-accuracy-loss", "--engines-dir", str(tmp_path),
                             "--name", "q", "--no-repo")
    assert code == 0, err
    assert f"head scores its {KEEP} most used tokens" in out
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    accuracy = manifest["draft"]["quant"]["accuracy"]
    assert np.isfinite(accuracy["ppl_quant"]) and 0.5 < accuracy["top1_agreement"] <= 1
    for engine in ("draft", "draft-fp32"):  # the reference is sliced alike, so the two compare column for column
        assert json.loads((tmp_path / "q" / engine / "engine.json").read_text())["vocab_size"] == KEEP
    assert json.loads((tmp_path / "q" / "draft" / "engine.json").read_text())["kv_layout"] == "shared"


def test_draft_vocab_without_ranking_is_a_one_line_error(capsys, tiny_target, tiny_draft, tmp_path):
    code, _, err = run_cli(capsys, "build", "--target", str(tiny_target), "--draft", str(tiny_draft), "--draft-vocab", "64",
                        "--engines-dir", str(tmp_path), "--no-repo")
    assert code == 2 and f"has no {FILE}" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir()), "nothing is written before the check"


def test_draft_vocab_needs_a_draft_model(capsys, tiny_target, tmp_path):
    code, _, err = run_cli(capsys, "build", "--target", str(tiny_target), "--draft", "ngram", "--draft-vocab", "64",
                           "--engines-dir", str(tmp_path), "--no-repo")
    assert code == 2 and "--draft-vocab applies to a draft model" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


def test_slicing_a_head_whose_matrix_the_embedding_also_reads_leaves_the_embedding_whole():
    """onnxruntime-genai's builder ties the embedding to the head's initializer (Transpose + Gather): slicing
    it in place would cut the embedding's rows too (a planted in-place slice fails this)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specpipe.quantize.graph import slice_lm_head

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 10)).astype(np.float32)  # [hidden, vocab]
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["head.weight"], ["table"], name="/embed/Transpose", perm=[1, 0]),
         helper.make_node("Gather", ["table", "input_ids"], ["hidden"], name="/embed/Gather"),
         helper.make_node("MatMul", ["hidden", "head.weight"], ["logits"], name="/lm_head/MatMul")],
        "tied", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 2])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 2, 10])],
        [numpy_helper.from_array(weight, "head.weight")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    keep = np.array([7, 2, 9])
    slice_lm_head(model, keep)
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[8, 1]], dtype=np.int64)  # token 8 is not kept by the head; the embedding must still have it
    logits = session.run(None, {"input_ids": ids})[0]
    expected = weight.T[ids[0]] @ weight[:, keep]
    np.testing.assert_allclose(logits[0], expected, rtol=1e-5, atol=1e-5)
