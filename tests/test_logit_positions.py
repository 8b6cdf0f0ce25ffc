"""Logits only where they are read (export/logit_positions.py): the builder graph's `logits_index` input, and the
shared-KV engine's calls that ask for a prompt's last position only. Every check compares against the same graph
without the input (the builder's own), so a wrong position, row or axis fails."""

import shutil

import numpy as np
import onnx
import pytest

from specpipe.export.logit_positions import LOGITS_INDEX, add_logits_index


@pytest.fixture(scope="module")
def engines(tiny_target, tmp_path_factory):
    """tiny_target as two builder engines: as specpipe exports it (with `logits_index`) and as the builder wrote
    it (without: an engine exported before the input existed)."""
    from specpipe.checkpoint import inspect_checkpoint
    from specpipe.engines.onnxruntime import write_engine_meta
    from specpipe.engines.shared_kv import KV_LAYOUT
    from specpipe.export.ortgenai_builder import run_model_builder

    work = tmp_path_factory.mktemp("logit-positions")
    plain = run_model_builder(tiny_target, work / "plain", "fp32", work / "cache", logits_index=False)
    picking = work / "picking"
    shutil.copytree(plain, picking)
    add_logits_index(picking / "model.onnx")
    info = inspect_checkpoint(tiny_target)
    for out in (plain, picking):
        write_engine_meta(out, vocab_size=info.vocab_size, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
                          head_dim=info.head_dim, max_seq_len=256, quant="none", kv_layout=KV_LAYOUT)
    return plain, picking


def _sessions(engines):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return [ort.InferenceSession(str(folder / "model.onnx"), so, providers=["CPUExecutionProvider"]) for folder in engines]


def _feed(session, ids, lengths, head_dim):
    """A first call (nothing cached) on right-padded rows: each row's mask covers its own prompt."""
    rows, n = ids.shape
    feed = {"input_ids": ids, "attention_mask": (np.arange(n)[None, :] < lengths[:, None]).astype(np.int64)}
    for item in session.get_inputs():
        if item.name.startswith("past_key_values."):
            feed[item.name] = np.zeros((rows, item.shape[1], 0, head_dim), np.float32)
    return feed


def test_the_graph_computes_logits_only_at_the_positions_asked_for(engines, tiny_target):
    """Each row's picked positions (its own last under right padding, several, repeated, out of order) equal the
    full graph's logits there: the same LM head on the same hidden states. Bit-identical on the Zen 4 machine it was
    written on, but ONNX Runtime does not promise one MatMul kernel for every row count, so the check allows float
    rounding; a wrong position or row is orders of magnitude further off."""
    from specpipe.checkpoint import inspect_checkpoint

    plain, picking = _sessions(engines)
    assert LOGITS_INDEX in {i.name for i in picking.get_inputs()} and LOGITS_INDEX not in {i.name for i in plain.get_inputs()}
    ids = np.random.default_rng(0).integers(3, 200, (3, 7))
    lengths = np.array([7, 4, 2])
    feed = _feed(plain, ids, lengths, inspect_checkpoint(tiny_target).head_dim)
    full = plain.run(["logits"], feed)[0]  # [3, 7, vocab]
    for index in (lengths[:, None] - 1, np.array([[0, 6], [3, 1], [1, 1]]), np.tile(np.arange(7), (3, 1))):
        picked = picking.run(["logits"], {**feed, LOGITS_INDEX: index.astype(np.int64)})[0]
        assert picked.shape == (3, index.shape[1], full.shape[2])  # the head ran on m positions, not 7
        np.testing.assert_allclose(picked, full[np.arange(3)[:, None], index], rtol=0, atol=1e-5)


def test_adding_the_input_twice_changes_nothing_and_a_graph_without_a_head_is_refused(engines, tmp_path):
    before = (engines[1] / "model.onnx").read_bytes()
    add_logits_index(engines[1] / "model.onnx")
    assert (engines[1] / "model.onnx").read_bytes() == before
    model = onnx.load(str(engines[0] / "model.onnx"), load_external_data=False)
    for value in [*model.graph.output, *(node for node in model.graph.node if "logits" in node.output)]:
        if isinstance(value, onnx.NodeProto):
            value.output[list(value.output).index("logits")] = "scores"
        elif value.name == "logits":
            value.name = "scores"
    onnx.save_model(model, str(tmp_path / "model.onnx"))
    with pytest.raises(ValueError, match="no MatMul produces 'logits'"):
        add_logits_index(tmp_path / "model.onnx")
    assert not (tmp_path / "model.onnx.tmp").exists()


@pytest.mark.parametrize("which", ["picking", "plain"])
def test_engine_calls_asking_for_the_last_logits_match_full_calls(engines, which):
    """Through the engine: a prompt's `append(last=1)`, a verify-sized `append(last=3)` and a batched prefill give
    the logits a full call gives at those positions, with the graph picking them or (an older engine) sliced."""
    from specpipe.engines.shared_kv import SharedKVEngine

    engine = SharedKVEngine(engines[1] if which == "picking" else engines[0], threads=1, min_rows=4)
    assert engine.selects_logits == (which == "picking")
    prompts = [[5, 9, 17, 33, 2, 8], [11, 4, 90], [7, 7, 30, 41, 12]]
    full = []
    for prompt in prompts:
        row = engine.new_sequence()
        full.append(row.append(prompt + [21, 22, 23]))
    for prompt, want in zip(prompts, full):
        row = engine.new_sequence()
        np.testing.assert_allclose(row.append(prompt, last=1), want[len(prompt) - 1 : len(prompt)], rtol=0, atol=1e-4)
        np.testing.assert_allclose(row.append([21, 22, 23], last=3), want[-3:], rtol=0, atol=1e-4)
        assert row.tokens == prompt + [21, 22, 23]
    batch = engine.new_batch(3)
    rows = [batch.new_sequence() for _ in prompts]
    last = batch.prefill(rows, prompts)
    for i, (prompt, want) in enumerate(zip(prompts, full)):
        np.testing.assert_allclose(last[i], want[len(prompt) - 1], rtol=0, atol=1e-4)


def test_planted_wrong_position_fails(engines, monkeypatch):
    """A prompt's call that picks the position before its last must fail the comparison above."""
    import specpipe.engines.shared_kv as shared_kv

    original = shared_kv.SharedKVEngine.run

    def off_by_one(self, buffers, input_ids, lengths, preempt=None, new_lengths=None, logits_at=None):
        return original(self, buffers, input_ids, lengths, preempt, new_lengths,
                        None if logits_at is None else np.maximum(logits_at - 1, 0))

    monkeypatch.setattr(shared_kv.SharedKVEngine, "run", off_by_one)
    with pytest.raises(AssertionError):
        test_engine_calls_asking_for_the_last_logits_match_full_calls(engines, "picking")
