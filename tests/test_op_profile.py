"""bench/op_profile.py: which run a profiled node belongs to (on a hand-made trace in ONNX Runtime's documented
format), and the tool end to end on a tiny builder engine (ONNX Runtime's real profiler)."""

import json
import shutil

import pytest

from specpipe.bench.op_profile import Shape, main, op_time_per_run, profile_shapes


def _run(ts, dur):
    return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}


def _node(ts, dur, op, name="n"):
    return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}


def test_nodes_are_counted_in_the_runs_that_hold_them_and_earlier_runs_are_left_out():
    events = [
        _run(0, 100), _node(10, 50, "MatMul"), _node(70, 20, "GroupQueryAttention"),  # a prefill: not counted
        _run(200, 100), _node(210, 30, "MatMul"), _node(250, 7, "GroupQueryAttention"),
        {"cat": "Node", "name": "n_fence_before", "ts": 260, "dur": 999, "args": {"op_name": "MatMul"}},  # not a kernel
        _node(350, 1000, "MatMul"),  # between two runs: nobody's
        _run(400, 100), _node(420, 40, "MatMul"), _node(480, 5, "Softmax"),
    ]
    totals, runs = op_time_per_run(events, last_runs=2)
    assert runs == 2
    assert totals == {"MatMul": 70, "GroupQueryAttention": 7, "Softmax": 5}
    totals, runs = op_time_per_run(events, last_runs=3)
    assert runs == 3 and totals["MatMul"] == 120 and totals["GroupQueryAttention"] == 27


@pytest.fixture(scope="module")
def tiny_engine(tiny_target, tmp_path_factory):
    from specpipe.checkpoint import inspect_checkpoint
    from specpipe.engines.onnxruntime import write_engine_meta
    from specpipe.engines.shared_kv import KV_LAYOUT
    from specpipe.export.logit_positions import add_logits_index
    from specpipe.export.ortgenai_builder import run_model_builder

    work = tmp_path_factory.mktemp("op-profile")
    folder = run_model_builder(tiny_target, work / "engine", "fp32", work / "cache", logits_index=False)
    add_logits_index(folder / "model.onnx")
    info = inspect_checkpoint(tiny_target)
    write_engine_meta(folder, vocab_size=info.vocab_size, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
                      head_dim=info.head_dim, max_seq_len=256, quant="none", kv_layout=KV_LAYOUT)
    return folder, info.num_layers


def test_each_shape_gets_its_calls_operators_and_wall_time(tiny_engine):
    folder, layers = tiny_engine
    shapes = [Shape(1, 8, 1), Shape(3, 8, 1), Shape(1, 8, 3)]
    results = profile_shapes(folder, shapes, threads=1, calls=4)
    assert [r.shape for r in results] == shapes
    for r in results:
        assert r.calls == 4 and r.wall_ms > 0 and r.kernel_ms > 0
        # every layer's attention runs in every call; the ops' times add up to the kernels' total
        assert "GroupQueryAttention" in r.ops and any(op.startswith("MatMul") for op in r.ops)
        assert sum(r.ops.values()) == pytest.approx(r.kernel_ms)
        assert list(r.ops.values()) == sorted(r.ops.values(), reverse=True)


def test_bad_shapes_are_refused_before_anything_runs(tiny_engine):
    folder, _ = tiny_engine
    with pytest.raises(ValueError, match="one new token each"):
        profile_shapes(folder, [Shape(2, 8, 2)], calls=1)
    with pytest.raises(ValueError, match=">= 1"):
        profile_shapes(folder, [Shape(1, 0, 1)], calls=1)


def test_the_command_writes_json_and_gives_one_line_errors(tiny_engine, tmp_path, capsys):
    folder, _ = tiny_engine
    out = tmp_path / "prof.json"
    assert main([str(folder), "--rows", "1,2", "--context", "8", "--new", "1,2", "--calls", "2", "--threads", "1",
                 "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    # 2 rows x 2 new tokens is not a shape ONNX Runtime runs: left out of the product
    assert [(s["shape"]["rows"], s["shape"]["new"]) for s in report["shapes"]] == [(1, 1), (1, 2), (2, 1)]
    assert report["machine"]["logical_cores"] >= 1
    capsys.readouterr()
    assert main([str(folder), "--rows", "one"]) == 2
    assert capsys.readouterr().out.startswith("error: 'one' is not")
    not_shared = tmp_path / "not-an-engine"
    shutil.copytree(folder, not_shared)
    (not_shared / "model.onnx").unlink()
    assert main([str(not_shared), "--calls", "1"]) == 2
    assert "error:" in capsys.readouterr().out
