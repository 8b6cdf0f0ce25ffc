"""The openvino peer with an EAGLE-3 head (bench/peers/openvino.py): the deployment's head (or `bench --draft HEAD`)
reaches the peer with the target layers it reads, is exported by optimum-intel in its own environment, and runs in
OpenVINO GenAI's EAGLE-3 pipeline reading those layers.

The first tests need nothing beyond specpipe. The last runs where the peer and its export environment are installed
(`make install-peers`), as the other peer runs do (tests/test_peers.py): a tiny 4-layer target with a random head
reading layers 0, 1, 2 (GenAI's EAGLE-3 takes exactly three), built, benched with `--peer openvino`. The exported
head must name exactly the head's layers (a planted export that leaves them out, so GenAI falls back to its own
default layers, fails that), and greedy output of every EAGLE-3 row must equal OpenVINO's own target alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpipe.bench.peers import missing_note, pair_from_manifest, peer_rows
from specpipe.bench.peers import openvino as ov_peer
from specpipe.errors import ExportError


def _manifest(tmp_path: Path) -> dict:
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    return {"target": {"resolved_path": str(target), "engine": {"quant": "int8-wo"}},
            "draft": {"kind": "eagle3", "path": "draft"}, "eos_token_ids": [2]}


def test_the_head_and_its_layers_reach_the_peers(tmp_path):
    pair, why = pair_from_manifest(_manifest(tmp_path), 2, [1, 2], head_dir=tmp_path / "head", head_layers=(1, 14, 26))
    assert why is None and pair.head_dir == tmp_path / "head" and pair.head_layers == (1, 14, 26)
    assert pair.draft_dir is None and pair.precision == "int8"
    pair, _ = pair_from_manifest(_manifest(tmp_path), 2, [1])  # a bench without a head
    assert pair.head_dir is None and pair.head_layers == ()


def test_a_head_bench_says_which_peers_run_it(tmp_path, monkeypatch):
    monkeypatch.setattr("specpipe.bench.peers.missing_note", lambda name: f"{name}: not installed")
    _, notes = peer_rows(["openvino"], _manifest(tmp_path), 2, [1], head_dir=tmp_path / "head", head_layers=(1, 2, 3))
    assert any("EAGLE-3 head" in note and "openvino" in note for note in notes), notes
    assert not any("no draft model" in note for note in notes)


def test_the_head_export_without_its_environment_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(ov_peer.EXPORT_PYTHON_ENV, str(tmp_path / "missing" / "python"))
    assert ov_peer.head_export_python() is None
    with pytest.raises(ExportError) as info:
        ov_peer.export_head(tmp_path / "head", (1, 2, 3))
    message = str(info.value)
    assert "\n" not in message and "make install-peers" in message and ov_peer.EXPORT_VENV in message


def test_genai_reads_exactly_three_layers(tmp_path, monkeypatch):
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setenv(ov_peer.EXPORT_PYTHON_ENV, str(python))
    assert ov_peer.head_export_python() == python
    with pytest.raises(ExportError, match="exactly 3"):
        ov_peer.export_head(tmp_path / "head", (1, 2))


# --- the real peer ---------------------------------------------------------------------------------------------


def _installed() -> str | None:
    return missing_note("openvino") or (None if ov_peer.head_export_python() else
                                        f"openvino eagle3: no head export environment ({ov_peer.EXPORT_VENV}; "
                                        "make install-peers)")


@pytest.fixture(scope="module")
def head_deployment(tiny_tokenizer, tmp_path_factory):
    note = _installed()
    if note:  # before building anything: where the peer is missing (CI) the build would be thrown away
        pytest.skip(note)
    from transformers import AutoModelForCausalLM
    import torch

    from specpipe.builder import build
    from specpipe.builder.config import BuildConfig
    from specpipe.checkpoint.eagle3 import head_config, write_eagle3_head
    from specpipe.distill.eagle3 import make_head
    from specpipe.testing.tiny import make_tiny_llama

    root = tmp_path_factory.mktemp("ov-eagle3")
    target = make_tiny_llama(root / "target", seed=0, num_layers=4, tokenizer=tiny_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(target)
    head = make_head(model, feature_layers=(0, 1, 2), draft_token_ids=torch.arange(0, model.config.vocab_size, 2),
                     warm_start=True, warm_attention=False, seed=0)
    folder = write_eagle3_head(root / "head", head.state_dict(), head_config(head.shape))
    return build(BuildConfig(target=str(target), draft=str(folder), name="ovhead", engines_dir=root / "engines",
                             repo_dir=None)), folder


def test_openvino_runs_the_deployments_head_reading_its_layers(head_deployment, tmp_path, monkeypatch, capsys):
    from specpipe.cli import main

    engines, head = head_deployment
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    try:
        main(["bench", str(engines), "--prompts-set", "code", "--max-prompts", "2", "--max-new-tokens", "12",
              "-k", "1,2", "--no-adaptive", "--warmup-prompts", "0", "--peer", "openvino", "--json"])
    except SystemExit as exit_info:
        assert exit_info.code in (0, None)
    results = json.loads(capsys.readouterr().out)
    assert not [n for n in results["peer_notes"] if "skipped" in n], results["peer_notes"]
    exported = list((tmp_path / "cache" / "peers" / "openvino").glob("*-eagle3-*"))
    assert len(exported) == 1 and ov_peer.head_layers_of(exported[0]) == [0, 1, 2]
    rows = {row["label"]: row for row in results["sets"][0]["rows"]}
    for k in (1, 2):
        row = rows[f"openvino eagle3 K={k}"]
        assert row["strategy"] == "eagle3-head" and row["k"] == k and row["tokens_per_s"] > 0
        assert row["matches_target"] == 2, row["mismatches"]  # greedy: OpenVINO's own target alone's tokens
        assert 0.0 <= row["acceptance_rate"] <= 1.0
        assert row["vs_specpipe"] == pytest.approx(row["tokens_per_s"] / rows[f"K={k}"]["tokens_per_s"])


def test_an_int4_export_names_a_group_that_divides_the_widths(tmp_path):
    """NNCF's default group of 128 fails on SmolLM2's 576-wide layers: the export names the largest that divides."""
    def options(hidden, inter):
        (tmp_path / "config.json").write_text(json.dumps({"hidden_size": hidden, "intermediate_size": inter}))
        return ov_peer.export_options(tmp_path, "int4")

    assert options(576, 1536) == ["--group-size", "64"]
    assert options(4096, 11008) == []  # 128 divides both: NNCF's default stands
    assert options(608, 1536) == ["--group-size", "32"]
    assert options(100, 300) == ["--group-size-fallback", "adjust"]
    assert ov_peer.export_options(tmp_path, "int8") == []
