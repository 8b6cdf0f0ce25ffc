"""The ONNX Runtime teacher: the target as build exports it answers the training prompts, giving the records the torch
teacher gives (greedy answers, top-k log-probs of the full softmax, features row t = position t), chosen by measurement,
cached apart from the torch teacher's data, exported once per run for the teacher and the verdict alike."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specpipe.distill.config import DistillConfig

LAYERS = (1, 3, 4)
TOP_K = 8
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def eight_layer_target(tmp_path_factory, tiny_tokenizer):
    from specpipe.testing.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("eight") / "ckpt", seed=2, num_layers=8, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="module")
def targets(eight_layer_target):
    from specpipe.distill.verdict import ExportedTargets

    with ExportedTargets(eight_layer_target, LAYERS) as exported:
        yield exported


@pytest.fixture(scope="module")
def model(eight_layer_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(eight_layer_target).eval()


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = ["def add(a, b):", "The quick brown fox jumps over", "Explain a compiler", "x = [1, 2, 3]\nfor i in x:",
             "Hello"]
    return [tiny_tokenizer(t)["input_ids"] for t in texts]  # different lengths: right vs left padding must not matter


def _onnx_batch(targets, quant: str = "none", rows: int = 8):
    from specpipe.engines import load_engine

    return load_engine(targets.folder(quant), threads=1).new_batch(rows)


def _answer_both(model, targets, prompts, **extra):
    from specpipe.distill.teacher import answer_prompts, answer_prompts_onnx

    common = dict(kinds=["code"] * len(prompts), max_new_tokens=NEW_TOKENS, eos_token_ids=set(), top_k=TOP_K,
                  feature_layers=LAYERS, **extra)
    reference = answer_prompts(model, prompts, pad_token_id=0, **common)
    onnx = answer_prompts_onnx(_onnx_batch(targets), prompts, **common)
    return reference, onnx


def mismatches(seq, reference, model) -> list[str]:
    """What differs between an ONNX teacher record and the torch fp32 teacher's on the same prompt, by the project's
    near-tie rule (speculative/equivalence.py): the answers may part only where the target's top two logits are
    within the fp32 tolerance, at the first difference (compared up to there). Against one fresh fp32 forward pass
    over the record's own tokens: every kept top-k log-prob (ids and values) and every feature row."""
    from specpipe.export.features import hf_hidden_state_index
    from specpipe.speculative.equivalence import first_difference, near_tie_tolerance

    problems = []
    tolerance = near_tie_tolerance("none")
    with torch.no_grad():
        out = model(seq.token_ids[None], output_hidden_states=True)
    logits = out.logits[0, :-1].double()  # row t: over token t+1
    logprobs = torch.log_softmax(logits, -1)
    prompt_len = seq.prompt_len
    if not torch.equal(seq.token_ids[:prompt_len], reference.token_ids[:prompt_len]):
        problems.append("different prompts")
    position = first_difference(seq.token_ids.tolist(), reference.token_ids.tolist())
    if position is not None:
        row = position - 1  # the row that chose token `position`
        top2 = logits[row].topk(2).values
        gap = float(logits[row].max() - logits[row, seq.token_ids[position]]) if position < len(seq) else 0.0
        if not (float(top2[0] - top2[1]) <= tolerance and gap <= tolerance):
            problems.append(f"answers differ at token {position} with top-2 margin {float(top2[0] - top2[1]):.2e}")
    # greedy: each answer token is the argmax of the row before it (or one of two near-tied)
    for t in range(prompt_len, len(seq)):
        gap = float(logits[t - 1].max() - logits[t - 1, seq.token_ids[t]])
        if gap > tolerance:
            problems.append(f"answer token {t} is {gap:.2e} below the argmax")
            break
    if seq.top_ids.shape != (len(seq) - 1, TOP_K):
        problems.append(f"top-k rows {tuple(seq.top_ids.shape)} for {len(seq)} tokens")
        return problems
    picked = logprobs.gather(1, seq.top_ids.long())
    error = float((picked - seq.top_logprobs.double()).abs().max())
    if error > 1e-2:  # float16 storage
        problems.append(f"top-k log-probs off by {error:.3f}")
    kth = logprobs.topk(TOP_K, -1).values
    if float((kth - seq.top_logprobs.double()).abs().max()) > 1e-2:
        problems.append("top-k rows are not each row's k most likely tokens")
    expected = torch.cat([out.hidden_states[hf_hidden_state_index(i)][0, :-1] for i in LAYERS], -1)
    if seq.features is None or seq.features.shape != expected.shape:
        problems.append(f"features {None if seq.features is None else tuple(seq.features.shape)}, not {tuple(expected.shape)}")
        return problems
    scale = float(expected.abs().max())
    error = float((seq.features.float() - expected).abs().max())
    if error > 2e-3 * max(1.0, scale):
        problems.append(f"features off by {error:.4f} (scale {scale:.1f})")
    return problems


def test_onnx_teacher_gives_the_torch_teachers_records(model, targets, prompts):
    """Greedy answers equal the torch fp32 teacher's (near-tie rule), the top-k log-probs and the features match the
    target's at every position, prompt rows included."""
    reference, onnx = _answer_both(model, targets, prompts)
    for seq, ref in zip(onnx, reference):
        assert len(seq) == len(ref) == seq.prompt_len + NEW_TOKENS
        assert mismatches(seq, ref, model) == []
        assert float((seq.features.float() - ref.features.float()).abs().max()) <= 2e-3 * max(
            1.0, float(ref.features.float().abs().max()))


@pytest.fixture(scope="module")
def chat_prompts(tiny_tokenizer):
    """Prompts that start with the same turn, as the chat template makes them (SmolLM2's: 24 tokens of ~44)."""
    system = tiny_tokenizer("system: you are a helpful assistant who answers briefly.\nuser:")["input_ids"]
    texts = ["def add(a, b):", "The quick brown fox jumps over", "Explain a compiler", "x = [1, 2, 3]"]
    return [system + tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_a_prefix_all_prompts_share_runs_once_and_the_records_stay_the_targets(model, targets, chat_prompts,
                                                                               monkeypatch):
    """The ONNX teacher runs the tokens its prompts share once (the first prompt's call); the others' calls run
    only their own tokens from a copy of its keys and values, and every record (answers, top-k rows, features,
    prompt rows included) still matches the torch teacher's and the target's own."""
    from specpipe.distill.teacher import SHARED_PREFIX_MIN, shared_prefix_length
    from specpipe.engines.shared_kv import SlotSequence

    shared = shared_prefix_length(chat_prompts)
    assert shared >= SHARED_PREFIX_MIN
    calls = []
    forward = SlotSequence._forward
    monkeypatch.setattr(SlotSequence, "_forward", lambda self, ids, last=None, **kw: (calls.append(len(ids)),
                                                                                       forward(self, ids, last, **kw))[1])
    reference, onnx = _answer_both(model, targets, chat_prompts)
    assert calls[: len(chat_prompts)] == [len(chat_prompts[0])] + [len(p) - shared for p in chat_prompts[1:]]
    for seq, ref in zip(onnx, reference):
        assert len(seq) == len(ref) == seq.prompt_len + NEW_TOKENS
        assert mismatches(seq, ref, model) == []


def test_a_shifted_row_fails_the_comparison(model, targets, prompts):
    """The comparison catches a one-position shift of the features or of the top-k rows, and a wrong answer."""
    from specpipe.distill.teacher import TeacherSequence

    reference, onnx = _answer_both(model, targets, prompts[:2])
    seq, ref = onnx[0], reference[0]
    t = seq.prompt_len + 2  # an answer row

    def planted(**changes) -> TeacherSequence:
        values = dict(token_ids=seq.token_ids, top_ids=seq.top_ids, top_logprobs=seq.top_logprobs,
                      prompt_len=seq.prompt_len, kind=seq.kind, features=seq.features)
        return TeacherSequence(**{**values, **changes})

    shifted_features = seq.features.clone()
    shifted_features[t] = seq.features[t + 1]
    assert any("features" in p for p in mismatches(planted(features=shifted_features), ref, model))
    shifted_ids, shifted_lp = seq.top_ids.clone(), seq.top_logprobs.clone()
    shifted_ids[t], shifted_lp[t] = seq.top_ids[t + 1], seq.top_logprobs[t + 1]
    assert mismatches(planted(top_ids=shifted_ids, top_logprobs=shifted_lp), ref, model)
    wrong = seq.token_ids.clone()
    wrong[t] = int(seq.top_ids[t - 1, 3])  # the 4th most likely token, far from a near-tie on a random model
    assert any("answer" in p for p in mismatches(planted(token_ids=wrong), ref, model))


def test_int8_teacher_records_line_up(targets, prompts):
    """The int8 weight-only engine (the demo's deployed target): records of the same shapes, features of every
    position, sampled answers reproducible from the seed; eos ends a row early and its last token gets no row."""
    from specpipe.distill.teacher import answer_prompts_onnx

    batch = _onnx_batch(targets, "int8-wo")
    common = dict(kinds=["code"] * len(prompts), max_new_tokens=NEW_TOKENS, top_k=TOP_K, feature_layers=LAYERS,
                  temperature=0.7)
    first = answer_prompts_onnx(batch, prompts, eos_token_ids=set(), generator=torch.Generator().manual_seed(5), **common)
    again = answer_prompts_onnx(batch, prompts, eos_token_ids=set(), generator=torch.Generator().manual_seed(5), **common)
    assert not batch.rows  # every row released
    for a, b in zip(first, again):
        assert torch.equal(a.token_ids, b.token_ids)
        assert a.top_ids.shape[0] == a.features.shape[0] == len(a) - 1 == a.prompt_len + NEW_TOKENS - 1
    # greedy on the fp32 engine: rows ending early change later calls' row counts, not a row's answer
    batch = _onnx_batch(targets, "none")
    common.update(temperature=0.0)
    greedy = answer_prompts_onnx(batch, prompts, eos_token_ids=set(), **common)
    stop = int(greedy[0].token_ids[greedy[0].prompt_len + 3])  # row 0's 4th answer token ends its answer
    ended = answer_prompts_onnx(batch, prompts, eos_token_ids={stop}, **common)
    assert ended[0].answer_tokens <= 4 and int(ended[0].token_ids[-1]) == stop
    for seq, whole in zip(ended, greedy):
        assert seq.top_ids.shape[0] == seq.features.shape[0] == len(seq) - 1
        assert torch.equal(seq.token_ids, whole.token_ids[: len(seq)])


def test_a_deadline_cuts_onnx_answers_where_they_are(model, targets, prompts):
    from specpipe.distill.teacher import answer_prompts_onnx

    batch = _onnx_batch(targets)
    common = dict(kinds=["code"] * len(prompts), max_new_tokens=6, eos_token_ids=set(), top_k=TOP_K,
                  feature_layers=LAYERS)
    full = answer_prompts_onnx(batch, prompts, **common)
    cut = answer_prompts_onnx(batch, prompts, **common, deadline=0.0)
    for whole, part, ids in zip(full, cut, prompts):
        assert len(whole) == len(ids) + 6 and len(part) == len(ids) + 1
        assert torch.equal(part.token_ids, whole.token_ids[: len(part)])
        assert part.top_ids.shape[0] == part.features.shape[0] == len(part) - 1


def test_the_engine_must_output_the_asked_features(eight_layer_target, prompts, tmp_path):
    from specpipe.distill.teacher import answer_prompts_onnx
    from specpipe.distill.verdict import ExportedTargets

    with ExportedTargets(eight_layer_target, (1, 2, 5)) as other:
        with pytest.raises(ValueError, match="features of layers"):
            answer_prompts_onnx(_onnx_batch(other), prompts, kinds=["code"] * len(prompts), max_new_tokens=2,
                                eos_token_ids=set(), top_k=TOP_K, feature_layers=LAYERS)


def test_cache_keys_tell_the_teachers_apart():
    """The torch teacher's key is what it was (its caches stay valid); each ONNX precision has a key of its own."""
    from types import SimpleNamespace

    from specpipe.distill.run import _teacher_cache_key
    from specpipe.distill.teachers import Teacher

    cfg = DistillConfig(target="t", out=Path("o"))
    target = SimpleNamespace(weights_sha256="abc")
    cpu = torch.device("cpu")
    keys = {name: _teacher_cache_key(cfg, target, [], "answers", Teacher.parse(name), cpu, LAYERS)
            for name in ("torch float32", "torch bfloat16", "onnx fp32", "onnx int8-wo")}
    assert len({repr(sorted(k.items())) for k in keys.values()}) == 4
    assert keys["torch float32"]["dtype"] == "float32" and "teacher" not in keys["torch float32"]
    assert set(keys["torch float32"]) == {"format", "source", "target_weights", "prompts", "max_answer_tokens", "top_k",
                                          "dtype", "sample_temperature", "batch", "seed", "features"}
    assert keys["onnx int8-wo"]["teacher"]["quant"] == "int8-wo" and "dtype" not in keys["onnx int8-wo"]
    assert Teacher.parse("onnx fp32") == Teacher("onnx", "none") and Teacher("onnx", "none").name == "onnx fp32"


def test_teacher_candidates_and_the_choice():
    from specpipe.distill.teachers import Teacher, choose_teacher, teacher_candidates
    from specpipe.errors import UsageError

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    both = teacher_candidates("auto", "auto", cpu, ["none", "int8-wo"], ["answers"])
    assert [t.name for t in both] == ["torch float32", "torch bfloat16", "onnx fp32", "onnx int8-wo"]
    assert [t.name for t in teacher_candidates("auto", "float32", cpu, ["int8-wo"], ["answers"])] == [
        "torch float32", "onnx int8-wo"]
    assert all(t.engine == "torch" for t in teacher_candidates("auto", "auto", gpu, ["none"], ["answers"]))
    assert all(t.engine == "torch" for t in teacher_candidates("auto", "auto", cpu, ["none"], ["answers", "stdlib"]))
    assert [t.name for t in teacher_candidates("onnx", "auto", cpu, ["int8-wo"], ["answers"])] == ["onnx int8-wo"]
    with pytest.raises(UsageError):
        teacher_candidates("onnx", "auto", cpu, ["none"], ["answers", "stdlib"])

    rates = {"torch float32": 100.0, "torch bfloat16": 250.0, "onnx fp32": 200.0, "onnx int8-wo": 600.0}
    fake = lambda calls, device: {name: rates[name] for name in calls}  # noqa: E731
    choice = choose_teacher(both, cpu, lambda teacher: (lambda: 1), measure=fake)
    assert choice.dtype == "onnx int8-wo" and choice.tokens_per_s == rates
    rates["torch bfloat16"] = 900.0  # the rule follows the measurement, whichever wins
    assert choose_teacher(both, cpu, lambda teacher: (lambda: 1), measure=fake).dtype == "torch bfloat16"
    alone = choose_teacher([Teacher("onnx", "int8-wo")], cpu, lambda teacher: pytest.fail("measured"), measure=fake)
    assert alone.dtype == "onnx int8-wo" and alone.tokens_per_s == {}


def test_close_probes_go_to_a_run_off_on_the_runs_own_batch():
    """The probe's 16 short rows rank the candidates; those within RUNOFF_WITHIN of the best answer the run's batch
    and the fastest there is chosen (an AVX2 EPYC: int8-wo led the probe, fp32 the 48-row batches). A clear probe
    winner needs no run-off."""
    from specpipe.distill.teachers import RUNOFF_WITHIN, Teacher, choose_teacher, teacher_candidates

    cpu = torch.device("cpu")
    both = teacher_candidates("auto", "auto", cpu, ["none", "int8-wo"], ["answers"])
    probe = {"torch float32": 38.0, "torch bfloat16": 16.0, "onnx fp32": 72.0, "onnx int8-wo": 84.0}
    batch = {"torch float32": 40.0, "torch bfloat16": 20.0, "onnx fp32": 181.0, "onnx int8-wo": 142.0}
    measured = []

    def fake(calls, device):
        kind = {call() for call in calls.values()}.pop()  # each call returns which measurement it is
        measured.append((kind, sorted(calls)))
        return {name: (probe if kind == "probe" else batch)[name] for name in calls}

    choice = choose_teacher(both, cpu, lambda teacher: (lambda: "probe"), measure=fake,
                            make_runoff=lambda teacher: (lambda: "batch"))
    assert measured == [("probe", sorted(probe)), ("batch", ["onnx fp32", "onnx int8-wo"])]
    assert choice.dtype == "onnx fp32"
    assert choice.tokens_per_s == {**probe, "onnx fp32 (run-off)": 181.0, "onnx int8-wo (run-off)": 142.0}
    assert "onnx fp32 (run-off) 181" in choice.describe()
    measured.clear()
    probe["onnx fp32"] = 84.0 * RUNOFF_WITHIN - 1  # clearly behind: the probe decides alone
    choice = choose_teacher(both, cpu, lambda teacher: (lambda: "probe"), measure=fake,
                            make_runoff=lambda teacher: pytest.fail("a run-off"))
    assert choice.dtype == "onnx int8-wo" and [kind for kind, _ in measured] == ["probe"]


def test_a_run_off_counts_its_first_calls():
    """compare(warm_up=False): the candidates are warm from the probe, so a long call's first run is its measurement
    (a 48-row run-off call takes seconds) and it is not run again."""
    from specpipe.distill.precision import compare

    counts = {"a": 0, "b": 0}

    def call(name):
        def run():
            counts[name] += 1
            return 10
        return run

    rates = compare({name: call(name) for name in counts}, torch.device("cpu"), seconds=0.0, warm_up=False)
    assert counts == {"a": 1, "b": 1} and set(rates) == {"a", "b"}


def test_distill_with_the_onnx_teacher_exports_each_precision_once(eight_layer_target, tmp_path, monkeypatch):
    """--kind eagle3 --teacher-engine onnx: the head trains on the engine's answers; the verdict times the same
    exported engine (one export per precision in the whole run), and the record names the teacher."""
    from specpipe.distill import distill
    from specpipe.distill import teachers
    from specpipe.distill import verdict

    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    exports = []
    original = verdict.export_engine

    def counting(checkpoint, out, **kwargs):
        exports.append(kwargs.get("quant", "none"))
        return original(checkpoint, out, **kwargs)

    monkeypatch.setattr(verdict, "export_engine", counting)
    # whether the probe's two rates fall close enough for a run-off depends on the CPU (CI's was, the author's not):
    # every probe goes to one here, so the run is the same on any machine and the run-off's calls are counted too
    monkeypatch.setattr(teachers, "RUNOFF_WITHIN", 0.0)
    cfg = DistillConfig(target=str(eight_layer_target), out=tmp_path / "head", kind="eagle3", minutes=5,
                        answer_tokens=200, train_tokens=1000, answer_batch=8, max_answer_tokens=12, batch_tokens=256,
                        head_vocab=64, feature_layers=list(LAYERS), teacher_engine="onnx", train_dtype="float32",
                        verdict_quant=["none", "int8-wo"])
    record = distill(cfg).record
    assert record["precision"]["teacher"]["dtype"] in {"onnx fp32", "onnx int8-wo"}
    assert set(record["precision"]["teacher"]["tokens_per_s"]) == {"onnx fp32", "onnx int8-wo", "onnx fp32 (run-off)",
                                                                   "onnx int8-wo (run-off)"}
    rates = record["precision"]["teacher"]["tokens_per_s"]
    runoff_winner = max(("onnx fp32", "onnx int8-wo"), key=lambda name: rates[f"{name} (run-off)"])
    assert record["precision"]["teacher"]["dtype"] == runoff_winner
    assert record["data"]["answer_tokens"] > 0 and record["training"]["tokens_seen"] >= 1000
    assert set(record["verdict"]["by_target_quant"]) == {"none", "int8-wo"}
    assert sorted(exports) == ["int8-wo", "none"]  # the teacher's engines are the verdict's: none exported twice


def test_the_onnx_teachers_rows_each_answer_from_a_batch_of_that_many(model, targets, prompts):
    """Teachers.rows_call: the ONNX teacher answers N prompts from a KV batch of N rows (one per row count asked
    for), the answers are those of the run's own batch, and keep_rows leaves only the chosen count's batch."""
    from specpipe.distill.teacher import answer_prompts_onnx
    from specpipe.distill.teachers import ROWS_NEW_TOKENS, Teacher, Teachers

    teacher = Teacher("onnx", "none")
    teachers = Teachers(model, torch.device("cpu"), targets=targets, batch_rows=2, top_k=TOP_K, feature_layers=LAYERS)
    try:
        for n in (2, 3, 5):
            assert teachers.rows_call(teacher, prompts[:n])() == n * ROWS_NEW_TOKENS
            assert teachers.onnx_batch("none", n).max_rows == n and not teachers.onnx_batch("none", n).rows
        common = dict(kinds=["code"] * 5, max_new_tokens=NEW_TOKENS, eos_token_ids=set(), top_k=TOP_K,
                      feature_layers=LAYERS)
        ours = teachers.answerer(teacher, 5)(prompts, **common)
        reference = answer_prompts_onnx(_onnx_batch(targets, rows=8), prompts, **common)
        assert [s.token_ids.tolist() for s in ours] == [s.token_ids.tolist() for s in reference]
        teachers.keep_rows(3)
        assert sorted(k[2] for k in teachers.made if k[0] == "onnx") == [3] and teachers.batch_rows == 3
        assert teachers.answerer(teacher).args[0].max_rows == 3
    finally:
        teachers.release()


def test_distill_measures_the_onnx_teachers_rows_and_answers_at_the_choice(eight_layer_target, tmp_path, monkeypatch):
    """--teacher-engine onnx with two candidate rows: both are timed, the run answers at the chosen rows (here the
    most: ROWS_GAIN 0 makes the rule pick them on any machine, so a run still answering from the first candidate's
    2-row batch fails: 4 prompts do not fit it), and the record and the cache key say so."""
    from specpipe.distill import distill, teachers
    from specpipe.distill.teacher import META

    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(teachers, "ROWS_GAIN", 0.0)
    cfg = DistillConfig(target=str(eight_layer_target), out=tmp_path / "head", kind="eagle3", minutes=5,
                        answer_tokens=120, train_tokens=300, answer_batch=2, answer_batches=[2, 4], max_answer_tokens=12,
                        batch_tokens=256, head_vocab=64, feature_layers=list(LAYERS), teacher_engine="onnx",
                        train_dtype="float32", verdict_quant=["none"], verdict=False)
    record = distill(cfg).record
    assert record["precision"]["teacher"]["dtype"] == "onnx fp32"
    rows = record["precision"]["teacher rows"]
    assert rows["dtype"] == "4" and set(rows["tokens_per_s"]) == {"2 rows", "4 rows"}
    assert record["data"]["answer_batch"] == 4 and record["data"]["answer_tokens"] > 0
    keys = [json.loads(p.read_text())["key"] for p in (tmp_path / "cache" / "distill-data").glob(f"*/{META}")]
    assert [k["batch"] for k in keys if k.get("source") == "answers"] == [4]
