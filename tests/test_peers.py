"""`specpipe bench --peer`: parsing, the missing-peer note, the ratio and self-equality checks, and a small real
run of each peer that is installed (skipped, with the reason, only where its package is absent: CI installs
'.[dev]' without the `peers` extra)."""

from __future__ import annotations

import json

import pytest

from specpipe.bench.harness import Measurement
from specpipe.bench.peers import PEER_NAMES, missing_note, missing_packages, parse_peers, peer_rows
from specpipe.bench.peers.common import cut_at_eos, with_eos
from specpipe.bench.peers.compare import add_vs_specpipe, check_against_own, first_difference, mismatches, peer_best
from specpipe.cli import main
from specpipe.errors import UsageError


def test_parse_peers():
    assert parse_peers("hf") == ["hf"]
    assert parse_peers(" openvino, ortgenai ,openvino") == ["openvino", "ortgenai"]
    assert parse_peers("all") == list(PEER_NAMES) == ["hf", "openvino", "ortgenai", "llamacpp"]
    assert parse_peers("none") == [] and parse_peers("") == []
    with pytest.raises(UsageError, match="unknown peer vllm"):
        parse_peers("hf,vllm")


def test_bad_peer_on_the_command_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", str(tmp_path), "--peer", "hf,tensorrt"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "unknown peer tensorrt" in err and "Traceback" not in err


def test_a_missing_peer_is_one_note_line(monkeypatch):
    from specpipe.bench import peers

    monkeypatch.setitem(peers.PEERS, "llamacpp", peers.PeerSpec("llamacpp", ("no_such_module_xyz",), "llama.cpp",
                                                                 ("llama-cpp-python",), "peers-llamacpp"))
    assert missing_packages("llamacpp") == ["no_such_module_xyz"]
    note = missing_note("llamacpp")
    assert note == "llamacpp: not installed (no_such_module_xyz missing; pip install 'specpipe[peers-llamacpp]')"
    assert missing_note("hf") is None  # transformers and torch come with specpipe


def test_missing_peers_leave_the_bench_running(tiny_target, tmp_path, capsys, monkeypatch):
    """A bench asking for a peer that is not installed prints its rows and a note, and exits 0."""
    from specpipe.bench import peers
    from specpipe.builder import build
    from specpipe.builder.config import BuildConfig

    for name in ("openvino", "ortgenai", "llamacpp"):
        monkeypatch.setitem(peers.PEERS, name, peers.PeerSpec(name, ("no_such_module_xyz",), name, (name,)))
    engine = build(BuildConfig(target=str(tiny_target), draft="none", name="alone", engines_dir=tmp_path, repo_dir=None))
    main_args = ["bench", str(engine), "--prompts-set", "code", "--max-prompts", "1", "--max-new-tokens", "4",
                 "--warmup-prompts", "0", "--peer", "openvino,ortgenai,llamacpp"]
    try:
        main([*main_args, "--json"])
    except SystemExit as exit_info:
        assert exit_info.code in (0, None)
    results = json.loads(capsys.readouterr().out)
    assert [row["label"] for row in results["sets"][0]["rows"]] == ["target-only"]
    notes = results["peer_notes"]
    assert any(note.startswith("peers: no draft model") for note in notes)
    assert [n.split(":")[0] for n in notes if "not installed" in n] == ["openvino", "ortgenai", "llamacpp"]
    assert results["peer_versions"] == {}
    try:
        main(main_args)
    except SystemExit as exit_info:
        assert exit_info.code in (0, None)
    assert "peer note: llamacpp: not installed" in capsys.readouterr().out


def test_peer_rows_without_checkpoints_is_a_note():
    manifest = {"target": {"resolved_path": "/nonexistent/target"}, "draft": {"kind": "none"}}
    rows, notes = peer_rows(["hf", "openvino"], manifest, threads=2, draft_lengths=[2])
    assert rows == [] and notes == ["hf, openvino: skipped: the target's torch checkpoint is not found (/nonexistent/target)"]


def _row(label, peer, strategy, k, tps):
    return {"label": label, "peer": peer, "strategy": strategy, "k": k, "tokens_per_s": tps, "acceptance_rate": None,
            "own_speedup": None}


def test_ratio_to_specpipes_same_row():
    table = [_row("target-only", None, "target-only", None, 20.0), _row("K=2", None, "draft-model", 2, 30.0),
             _row("adaptive", None, "draft-model", None, 32.0),
             _row("ov target-only", "openvino", "target-only", None, 25.0), _row("ov K=2", "openvino", "draft-model", 2, 15.0),
             _row("ov K=3", "openvino", "draft-model", 3, 16.0), _row("ov adaptive", "openvino", "draft-model", None, 16.0),
             _row("ov prompt-lookup", "openvino", "prompt-lookup", None, 24.0)]
    rows = {row["label"]: row for row in add_vs_specpipe(table)}
    assert rows["ov target-only"]["vs_specpipe"] == pytest.approx(25 / 20)
    assert rows["ov K=2"]["vs_specpipe"] == pytest.approx(15 / 30)
    assert rows["ov K=3"]["vs_specpipe"] is None  # specpipe ran no K=3
    assert rows["ov adaptive"]["vs_specpipe"] == pytest.approx(16 / 32)  # own mode beside specpipe's adaptive
    assert rows["ov prompt-lookup"]["vs_specpipe"] is None  # specpipe drafts with a model here
    assert rows["K=2"]["vs_specpipe"] is None  # specpipe's own rows are the reference
    assert peer_best(table)["openvino"]["label"] == "ov prompt-lookup"


def _runs(*id_lists, ms=1000.0):
    return [Measurement(f"p{i}", len(ids), ms, 100.0, token_ids=list(ids)) for i, ids in enumerate(id_lists)]


def test_equality_with_the_peers_own_target_only():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 4], [1, 2, 3]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2  # stopped early: a difference too
    own = _runs([1, 2, 3], [4, 5, 6], [7, 8], ms=1000.0)
    spec = _runs([1, 2, 3], [4, 9, 6], [7, 8], ms=500.0)
    assert mismatches(spec, own) == [{"prompt_id": "p1", "first_difference_at": 1}]
    row = check_against_own({"tokens_per_s": 5.0}, spec, own)
    # paired by prompt, as the harness's speedup: every prompt ran twice as fast as its own target-only run
    assert row["matches_target"] == 2 and row["own_speedup"] == pytest.approx(2.0)
    assert row["own_speedup_ci95"] == pytest.approx([2.0, 2.0])
    assert row["mismatches"] == [{"prompt_id": "p1", "first_difference_at": 1}]
    assert check_against_own({"tokens_per_s": 5.0}, spec, None)["matches_target"] is None


def test_eos_conventions():
    assert with_eos([5, 6], [2], stopped_on_eos=True) == [5, 6, 2]
    assert with_eos([5, 6, 2], [2], stopped_on_eos=True) == [5, 6, 2]
    assert with_eos([5, 6], [2], stopped_on_eos=False) == [5, 6]
    assert cut_at_eos([5, 2, 7, 2], [2]) == [5, 2]


# --- real runs on the tiny pair, one per installed peer ----------------------------------------------------------


@pytest.fixture(scope="module")
def peer_engine(tiny_target, tiny_tokenizer, tmp_path_factory):
    """target + a 1-layer draft with head size 16 (onnxruntime-genai's GroupQueryAttention needs a multiple of 16),
    both built from f32 GGUFs so llama.cpp runs the same weights."""
    from specpipe.builder import build
    from specpipe.builder.config import BuildConfig
    from specpipe.testing.tiny import make_tiny_llama
    from tests.test_gguf import write_llama_gguf

    root = tmp_path_factory.mktemp("peer-pair")
    draft = make_tiny_llama(root / "draft", seed=1, num_layers=1, hidden_size=64, tokenizer=tiny_tokenizer)
    # "smollm": a pre-tokenizer name both llama.cpp and specpipe's GGUF reader know (llama.cpp refuses "gpt2").
    target_gguf = write_llama_gguf(tiny_target, root / "target.gguf", pre="smollm")
    draft_gguf = write_llama_gguf(draft, root / "draft.gguf", pre="smollm")
    return build(BuildConfig(target=str(target_gguf), draft=str(draft_gguf), name="peers", engines_dir=root / "engines",
                             repo_dir=None))


@pytest.mark.parametrize("peer", ["hf", "openvino", "ortgenai", "llamacpp"])
def test_each_installed_peer_runs_on_the_tiny_pair(peer, peer_engine, tmp_path, monkeypatch, capsys):
    note = missing_note(peer)
    if note:
        pytest.skip(note)
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))  # conversions go to a fresh cache
    try:
        main(["bench", str(peer_engine), "--prompts-set", "code", "--max-prompts", "2", "--max-new-tokens", "12",
              "-k", "2", "--no-adaptive", "--warmup-prompts", "0", "--peer", peer, "--json"])
    except SystemExit as exit_info:
        assert exit_info.code in (0, None)
    results = json.loads(capsys.readouterr().out)
    assert not [n for n in results["peer_notes"] if n.startswith(f"{peer}: skipped")], results["peer_notes"]
    assert all(version != "?" for version in results["peer_versions"].values()) and results["peer_versions"]
    rows = {row["label"]: row for row in results["sets"][0]["rows"]}
    mine = {label: row for label, row in rows.items() if row["peer"] == peer}
    assert f"{peer} target-only" in mine and f"{peer} K=2" in mine and f"{peer} prompt-lookup" in mine
    for row in mine.values():
        assert row["tokens_per_s"] > 0 and row["ttft_ms"] > 0 and row["prompts"] == 2
        # Greedy: every speculative mode of a peer must give its own target-only tokens.
        assert row["matches_target"] == 2, (row["label"], row["mismatches"])
    assert mine[f"{peer} target-only"]["vs_specpipe"] == pytest.approx(
        mine[f"{peer} target-only"]["tokens_per_s"] / rows["target-only"]["tokens_per_s"])
    assert mine[f"{peer} K=2"]["vs_specpipe"] is not None and mine[f"{peer} K=2"]["k"] == 2
    if peer in ("openvino", "ortgenai"):  # the peers that report their drafts
        assert 0.0 <= mine[f"{peer} K=2"]["acceptance_rate"] <= 1.0


def test_the_model_builder_view_fills_rope_scaling(tiny_target, tmp_path):
    from specpipe.export.ortgenai_builder import _checkpoint_view

    _checkpoint_view(tiny_target, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert (tmp_path / "model.safetensors").resolve() == (tiny_target / "model.safetensors").resolve()


def test_a_model_builder_failure_is_one_line(tmp_path):
    """Also without onnxruntime-genai installed: the subprocess fails and the error says where, in one line."""
    from specpipe.errors import ExportError
    from specpipe.export.ortgenai_builder import run_model_builder

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    with pytest.raises(ExportError) as info:
        run_model_builder(bad, tmp_path / "out", "fp32", tmp_path / "cache")
    assert "\n" not in str(info.value) and str(bad) in str(info.value)


# --- peers at int8 / int4, scored by specpipe's accuracy check ---------------------------------------------------


def test_compare_models_reads_a_planted_drift():
    """The metrics of any two logits functions: equal models agree exactly; a model whose logits favour another
    token everywhere loses top-1 agreement and perplexity."""
    import numpy as np

    from specpipe.quantize.accuracy import compare_models

    rng = np.random.default_rng(0)
    table = rng.standard_normal((10, 10)).astype(np.float32)  # next-token logits by current token

    def model(ids):
        return table[np.asarray(ids)]

    def drifted(ids):
        logits = model(ids).copy()
        logits[:, 3] += 20.0
        return logits

    batches = [rng.integers(0, 10, size=12).tolist() for _ in range(3)]
    same = compare_models(model, model, batches, mode="same")
    assert same.top1_agreement == 1.0 and same.ppl_rel_change == pytest.approx(0.0, abs=1e-12) and same.num_positions == 33
    worse = compare_models(model, drifted, batches, mode="drift")
    assert worse.top1_agreement < 0.5 and worse.ppl_rel_change > 0.5 and worse.mean_kl > 1.0


@pytest.fixture(scope="module")
def tiny_f32_gguf(tiny_target, tmp_path_factory):
    from tests.test_gguf import write_llama_gguf

    return write_llama_gguf(tiny_target, tmp_path_factory.mktemp("gguf") / "target.gguf", pre="smollm")


def test_llamacpp_int4_is_q4_0_by_llamas_quantize_and_scored_against_f32(tiny_target, tiny_f32_gguf, tiny_tokenizer,
                                                                          tmp_path, monkeypatch):
    """At int4 llama.cpp runs its own Q4_0 of the f32 GGUF (not the GGUF the checkpoint came from), and its accuracy
    is measured against the f32 GGUF: exact for f32 against itself, a drift for Q4_0."""
    note = missing_note("llamacpp")
    if note:
        pytest.skip(note)
    import llama_cpp

    from specpipe.bench.peers.common import PeerPair
    from specpipe.bench.peers.llamacpp import _file_type, accuracy, gguf_for
    from specpipe.contract.quant import QuantConfig
    from specpipe.quantize.calibration import evaluation_batches

    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    q4, note = gguf_for(tiny_target, tiny_f32_gguf, "int4")
    assert note is None and q4 != tiny_f32_gguf and _file_type(q4) == llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    batches = evaluation_batches(tiny_tokenizer, QuantConfig())[:3]
    pair = PeerPair(target_dir=tiny_target, draft_dir=None, eos_token_ids=(2,), threads=1, draft_lengths=(),
                    precision="int4", target_gguf=tiny_f32_gguf)
    report, name = accuracy(pair, batches)
    assert name == "q4_0" and report.num_positions > 0 and report.mean_kl > 0
    itself, _ = accuracy(PeerPair(**{**pair.__dict__, "precision": "fp32"}), batches)
    assert itself.top1_agreement == 1.0 and itself.mean_kl < 1e-6


def test_peer_accuracy_scores_each_peer_and_specpipe_against_the_budget(monkeypatch, tiny_target):
    """At a quantized deployment: specpipe's own numbers from its manifest, then each peer's `accuracy`, each held to
    the deployment's budget; a peer that fails is a note; nothing at fp32."""
    import types

    from specpipe.bench import peers
    from specpipe.contract.quant import AccuracyReport

    def report(top1):
        return AccuracyReport(mode="m", num_sequences=1, num_positions=10, ppl_ref=10.0, ppl_quant=10.2,
                              ppl_rel_change=0.02, top1_agreement=top1, mean_kl=0.01, max_kl=0.1)

    fakes = {"ortgenai": types.SimpleNamespace(accuracy=lambda pair, batches: (report(0.63), "its builder's default int4")),
             "llamacpp": types.SimpleNamespace(accuracy=lambda pair, batches: 1 / 0)}
    monkeypatch.setattr(peers, "peer_module", fakes.__getitem__)
    monkeypatch.setattr(peers, "missing_packages", lambda name: [])
    monkeypatch.setattr("specpipe.quantize.calibration.evaluation_batches", lambda tokenizer, cfg: [[1, 2, 3]])
    manifest = {"target": {"resolved_path": str(tiny_target), "engine": {"quant": "int4-wo"},
                           "quant": {"accuracy": report(0.95).as_dict(), "budget": {"min_top1_agreement": 0.9}}},
                "draft": {"kind": "none"}, "eos_token_ids": [2]}
    entries, notes = peers.peer_accuracy(["ortgenai", "llamacpp"], manifest, 1, tokenizer=None)
    assert [(e["peer"], e["precision"], e["within_budget"]) for e in entries] == [(None, "int4", True), ("ortgenai", "int4", False)]
    assert entries[1]["violations"][0]["metric"] == "top-1 agreement"
    assert notes[1].startswith("accuracy ortgenai its builder's default int4 vs its fp32") and "over the budget" in notes[1]
    assert notes[2].startswith("accuracy llamacpp: skipped")
    fp32 = {**manifest, "target": {**manifest["target"], "engine": {"quant": "none"}}}
    assert peers.peer_accuracy(["ortgenai"], fp32, 1, tokenizer=None) == ([], [])


def test_llamacpp_prompt_lookup_takes_a_prompt_longer_than_its_batch(tiny_f32_gguf):
    """A prompt of more than llama.cpp's 512-token batch through the prompt-lookup row (a draft model): llama-cpp-python
    0.3.36 raised a ValueError in its eval unless the Llama is made with logits_all (peers/llamacpp.py `load`)."""
    note = missing_note("llamacpp")
    if note:
        pytest.skip(note)
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from specpipe.bench.peers.llamacpp import N_CTX, PROMPT_LOOKUP, LlamaGenerate, load

    prompt = [(7 * i) % 50 + 3 for i in range(700)]  # > 512 tokens, < N_CTX with the answer
    assert 512 < len(prompt) < N_CTX - 8
    alone = LlamaGenerate(load(tiny_f32_gguf, 1), [2])(prompt, 6)
    lookup = LlamaGenerate(load(tiny_f32_gguf, 1, draft_model=LlamaPromptLookupDecoding(**PROMPT_LOOKUP)), [2])(prompt, 6)
    assert alone.num_generated == lookup.num_generated == 6
    assert lookup.token_ids == alone.token_ids  # fp32: the lookup row's greedy output is the target's


def test_the_real_llama_cpp_takes_use_extra_bufts(tiny_f32_gguf):
    """The probe's fallback (peers/llamacpp.py `_llama`) reaches llama.h's `use_extra_bufts` through the binding."""
    note = missing_note("llamacpp")
    if note:
        pytest.skip(note)
    from specpipe.bench.peers import llamacpp

    off = llamacpp._llama(tiny_f32_gguf, extra_buffers=False, n_ctx=64, n_threads=1, verbose=False)
    assert off.model_params.use_extra_bufts is False
    off.eval([1, 2, 3])
    on = llamacpp._llama(tiny_f32_gguf, n_ctx=64, n_threads=1, verbose=False)
    assert on.model_params.use_extra_bufts is True
