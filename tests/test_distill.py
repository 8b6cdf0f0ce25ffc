"""`specpipe distill` on the tiny target: a few steps give a checkpoint that builds; restarts; bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specpipe.cli import main
from specpipe.distill.config import DistillConfig
from specpipe.testing.greedy import assert_greedy_equivalent


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPECPIPE_CACHE", str(folder))
    return folder


def _tiny_cfg(target: Path, out: Path, **overrides) -> DistillConfig:
    # A few seconds: a handful of target answers, then a few training steps.
    values = dict(target=str(target), out=out, layers=1, width=32, minutes=0.05, data_fraction=0.5, answer_batch=4,
                  max_answer_tokens=12, batch_tokens=256, checkpoint_every=2)
    return DistillConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def distilled(tiny_target, tmp_path_factory):
    """One distillation of the tiny target, shared by the tests that only read its output."""
    import os

    from specpipe.distill import distill

    root = tmp_path_factory.mktemp("distill")
    old = os.environ.get("SPECPIPE_CACHE")
    os.environ["SPECPIPE_CACHE"] = str(root / "cache")
    try:
        result = distill(_tiny_cfg(tiny_target, root / "draft"))
    finally:
        if old is None:
            os.environ.pop("SPECPIPE_CACHE")
        else:
            os.environ["SPECPIPE_CACHE"] = old
    return result


def test_distill_writes_a_checkpoint_that_shares_the_tokenizer(distilled, tiny_target):
    from transformers import AutoConfig, AutoModelForCausalLM

    from specpipe.checkpoint import load_tokenizer, tokenizer_hash

    out = distilled.path
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert not (out / ".distill").exists(), "the training state is removed once the draft is written"
    config = AutoConfig.from_pretrained(out)
    assert config.hidden_size == 32 and config.num_hidden_layers == 1
    assert config.vocab_size == AutoConfig.from_pretrained(tiny_target).vocab_size
    assert tokenizer_hash(load_tokenizer(out)) == tokenizer_hash(load_tokenizer(tiny_target))
    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()

    record = json.loads((out / "distill.json").read_text())
    assert record["training"]["steps"] >= 1
    assert record["data"]["answer_tokens"] > 0
    # a time budget: the run reports its split's rates (distill/split.py), training's from its own counts
    split, training = record["split"], record["training"]
    assert split["data_fraction"] == 0.5 and split["answer_tokens_per_s"] > 0
    assert split["train_tokens_per_s"] == pytest.approx(training["tokens_seen"] / training["seconds"], rel=0.1)
    assert split["answer_tokens"] >= record["data"]["answer_tokens"]  # the held-out prompts' answers too
    assert split["train_tokens_per_answer_token"] == pytest.approx(record["data"]["tokens"] / split["answer_tokens"],
                                                                   abs=1e-4)
    assert 0 < record["draft"]["weights_read_per_token_vs_target"] < 1
    # auto precision: both phases measured every candidate here and kept the faster; the teacher's candidates are
    # torch in each dtype and the ONNX engine at the verdict's precision (fp32 by default). Teacher probes within
    # RUNOFF_WITHIN of the best went on to a run-off that decided (whether any did depends on the CPU).
    from specpipe.distill.teachers import RUNOFF_WITHIN

    for phase, names in (("teacher", {"torch float32", "torch bfloat16", "onnx fp32"}), ("train", {"float32", "bfloat16"})):
        choice = record["precision"][phase]
        probed = {name: rate for name, rate in choice["tokens_per_s"].items() if not name.endswith(" (run-off)")}
        runoff = {name.removesuffix(" (run-off)"): rate for name, rate in choice["tokens_per_s"].items()
                  if name.endswith(" (run-off)")}
        close = {name for name, rate in probed.items() if rate >= RUNOFF_WITHIN * max(probed.values())}
        assert set(probed) == names
        assert set(runoff) == (close if phase == "teacher" and len(close) > 1 else set())
        decided = runoff or probed
        assert choice["dtype"] == max(decided, key=decided.get)
    assert record["device"] == "cpu"
    verdict = record["verdict"]  # the one-line verdict's numbers
    if record["held_out_agreement"] is not None:
        assert verdict["agreement"] == pytest.approx(record["held_out_agreement"], abs=1e-4)
    assert 0 <= verdict["agreement"] <= 1
    assert 1 <= verdict["best_k"] <= 16 and verdict["predicted_speedup"] > 0
    assert verdict["step_costs"]["draft"] > 0
    # timed as ONNX Runtime engines (what build runs), not torch steps
    assert "ONNX Runtime" in verdict["measured_with"] and verdict["step_ms"]["target_step_ms"] > 0

    from specpipe.checkpoint.draft_vocab import read_ranking

    ranking = read_ranking(out)  # the answers' tokens, most used first: `build` slices the head to them
    assert ranking["tokens"] >= record["data"]["answer_tokens"] and ranking["counts"] == sorted(ranking["counts"], reverse=True)


def test_distilled_draft_builds_and_decodes_like_the_target(distilled, tiny_target, tmp_path):
    from specpipe.builder import build
    from specpipe.builder.config import BuildConfig
    from specpipe.deployment import load_deployment

    folder = build(BuildConfig(target=str(tiny_target), draft=str(distilled.path), name="pair",
                               engines_dir=tmp_path / "engines", repo_dir=None))
    deployment = load_deployment(folder)
    prompt = deployment.generator.encode("def add(a, b):")
    spec = deployment.generator.generate(prompt, deployment.generation_config(num_draft_tokens=3, draft_length="fixed",
                                                                             max_new_tokens=16))
    alone = deployment.generator.generate(prompt, deployment.generation_config(speculative=False, max_new_tokens=16))
    assert_greedy_equivalent(deployment, prompt, spec.token_ids, alone.token_ids)  # a near-tie may flip between kernels (verify vs decode) on another CPU: not a bug
    assert spec.stats.drafted > 0


def test_training_learns_from_the_teacher(tiny_target, cache, tmp_path):
    """Loss falls and agreement with the target rises over a short run on the target's own answers."""
    from specpipe.checkpoint import load_causal_lm
    from specpipe.distill.student import make_student
    from specpipe.distill.teacher import answer_prompts
    from specpipe.distill.train import Trainer, agreement

    target = load_causal_lm(tiny_target)
    prompts = [[1, 5 + i, 40 + 3 * i, 77] for i in range(24)]
    data = answer_prompts(target, prompts, kinds=["code"] * 24, max_new_tokens=24, eos_token_ids={2}, pad_token_id=2,
                          top_k=16)
    student = make_student(target, layers=1, width=32, seed=0)
    before = agreement(student, data)
    trainer = Trainer(student, data, budget_s=1e9, lr=3e-3, batch_tokens=512, negatives=64, prompt_weight=0.2, seed=0,
                      state_path=tmp_path / "state.pt", checkpoint_every=0)
    losses = [trainer.step()[0] for _ in range(100)]
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10
    assert agreement(student, data) > before + 0.15


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def test_work_budgets_give_the_same_draft_whatever_was_cached(tiny_target, tmp_path, monkeypatch):
    """--answer-tokens/--train-tokens fix the work, not the time: the same budget and seed give the same
    data and the same weights, also when the cache holds answers from a run with a larger budget."""
    from specpipe.distill import distill

    budgets = dict(answer_tokens=60, train_tokens=1500, minutes=30, teacher_engine="torch", teacher_dtype="float32",
                   train_dtype="float32")
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "fresh"))
    fresh = distill(_tiny_cfg(tiny_target, tmp_path / "fresh-draft", **budgets))
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "reused"))
    larger = distill(_tiny_cfg(tiny_target, tmp_path / "larger", **{**budgets, "answer_tokens": 150}))
    reused = distill(_tiny_cfg(tiny_target, tmp_path / "reused-draft", **budgets))

    assert larger.record["data"]["answer_tokens"] > fresh.record["data"]["answer_tokens"] >= 60 - 12
    assert reused.record["data"] == fresh.record["data"]
    for record in (fresh.record, reused.record):
        assert 1500 <= record["training"]["tokens_seen"] < 1500 + 256  # stops after the step that reaches it
        assert record["split"] is None  # a work budget: --data-fraction is only a cap
    a, b = _weights(fresh.path), _weights(reused.path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert reused.record["kept_step"] == fresh.record["kept_step"]


def test_student_starts_as_the_target_projected(tiny_target):
    """Full width and depth: the projection is the identity, so the draft starts as the target exactly.
    Any orthonormal basis of the full width gives the same model up to the final norm's gain."""
    from specpipe.checkpoint import load_causal_lm
    from specpipe.distill.student import _project_layers, make_student

    target = load_causal_lm(tiny_target)
    ids = torch.tensor([[1, 5, 9, 30, 77, 12, 40]])
    with torch.no_grad():
        target_logits = target(ids).logits
        copy = make_student(target, layers=target.config.num_hidden_layers, width=0, seed=0)
        assert torch.allclose(copy(ids).logits, target_logits, atol=1e-5)

        torch.nn.init.ones_(target.model.norm.weight)  # a gain that commutes with any basis
        target_logits = target(ids).logits
        rotation, _ = torch.linalg.qr(torch.randn(target.config.hidden_size, target.config.hidden_size))
        rotated = make_student(target, layers=target.config.num_hidden_layers, width=0, seed=0)
        rotated.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight @ rotation)
        rotated.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight @ rotation)
        _project_layers(target, rotated, rotation)
        assert torch.allclose(rotated(ids).logits, target_logits, atol=1e-4)

        narrow = make_student(target, layers=1, width=32, seed=0, samples=[ids[0]])
        assert narrow.config.hidden_size == 32 and torch.isfinite(narrow(ids).logits).all()


def test_teacher_rows_are_the_targets_distributions(tiny_target):
    """Row t of the teacher data is the target's own distribution over token t+1 (prompt and answer alike)."""
    from specpipe.checkpoint import load_causal_lm
    from specpipe.distill.teacher import answer_prompts

    target = load_causal_lm(tiny_target)
    prompts = [[1, 9, 30], [1, 50, 51, 52, 53]]  # different lengths: left padding must not shift anything
    for seq in answer_prompts(target, prompts, kinds=["code", "chat"], max_new_tokens=6, eos_token_ids={2},
                              pad_token_id=2, top_k=8):
        with torch.no_grad():
            logprobs = torch.log_softmax(target(input_ids=seq.token_ids[None]).logits[0, :-1], -1)
        assert seq.top_ids.shape == (len(seq) - 1, 8)
        assert torch.equal(seq.top_ids[:, 0].long(), logprobs.argmax(-1))
        answer = seq.token_ids[seq.prompt_len :]
        assert torch.equal(answer, logprobs[seq.prompt_len - 1 :].argmax(-1))  # greedy answers
        picked = logprobs.gather(1, seq.top_ids.long())
        assert torch.allclose(picked, seq.top_logprobs.float(), atol=1e-2)


def test_teacher_data_is_cached_and_restart_continues(tiny_target, cache, tmp_path):
    from specpipe.distill import distill
    from specpipe.distill.progress import SilentProgress
    from specpipe.distill.train import Trainer

    class Notes(SilentProgress):
        def __init__(self):
            self.messages, self.phases = [], []

        def phase(self, name, total, description):
            self.phases.append(name)

        def log(self, message):
            self.messages.append(message)

    # The cache is keyed by the teacher and its precision. "auto" measures them, and where two run about as fast
    # (fp32 and bf16 on AVX512-BF16 CPUs) two runs may choose differently: this test states the cache rule, so it
    # fixes the teacher.
    distill(_tiny_cfg(tiny_target, tmp_path / "a", teacher_engine="torch", teacher_dtype="float32"))
    notes = Notes()
    distill(_tiny_cfg(tiny_target, tmp_path / "b", teacher_engine="torch", teacher_dtype="float32"), notes)
    assert "teacher" not in notes.phases and any("cached target answers" in m for m in notes.messages)

    # A stopped run's state is picked up again: same step, same weights.
    from specpipe.checkpoint import load_causal_lm
    from specpipe.distill.student import make_student
    from specpipe.distill.teacher import TeacherCache

    data = [s for folder in (cache / "distill-data").iterdir() for s in TeacherCache(folder, {}).load()]
    target = load_causal_lm(tiny_target)
    first = Trainer(make_student(target, layers=1, width=32, seed=0), data, budget_s=1e9, lr=1e-3, batch_tokens=256,
                    negatives=16, prompt_weight=0.2, seed=0, state_path=tmp_path / "state.pt", checkpoint_every=3)
    for _ in range(3):
        first.step()
    first.save()
    second = Trainer(make_student(target, layers=1, width=32, seed=1), data, budget_s=1e9, lr=1e-3, batch_tokens=256,
                     negatives=16, prompt_weight=0.2, seed=0, state_path=tmp_path / "state.pt", checkpoint_every=3)
    second.load()
    assert second.state.step == 3
    for a, b in zip(first.student.parameters(), second.student.parameters()):
        assert torch.equal(a, b)


def test_auto_teacher_precision_reuses_data_cached_whole_in_either_dtype(tiny_target, cache, tmp_path, monkeypatch):
    """Teacher data made by torch in bfloat16 (as asked) is reused by a run with --teacher-engine and --teacher-dtype
    auto without measuring: a measurement could pick another teacher where two run about as fast, and miss the cache.
    Nothing cached: it measures."""
    from specpipe.distill import distill
    from specpipe.distill import precision

    distill(_tiny_cfg(tiny_target, tmp_path / "a", teacher_engine="torch", teacher_dtype="bfloat16"))
    measured = []
    original = precision.choose_precision

    def choose(phase, *args, **kwargs):
        measured.append(phase)
        return original(phase, *args, **kwargs)

    monkeypatch.setattr(precision, "choose_precision", choose)
    result = distill(_tiny_cfg(tiny_target, tmp_path / "b"))
    assert "teacher" not in measured and result.record["precision"]["teacher"]["dtype"] == "torch bfloat16"
    distill(_tiny_cfg(tiny_target, tmp_path / "c", max_answer_tokens=10))  # other settings: nothing cached
    assert "teacher" in measured


def test_resume_continues_a_saved_run(tiny_target, cache, tmp_path):
    """--resume picks up OUT's saved state and trains only the time that is left."""
    from specpipe.distill import distill
    from specpipe.distill.run import STATE_DIR

    out = tmp_path / "draft"
    distill(_tiny_cfg(tiny_target, out))
    # Plant a state as a run stopped half-way would leave it, then resume from it.
    from specpipe.checkpoint import load_causal_lm
    from specpipe.distill.student import make_student
    from specpipe.distill.teacher import TeacherCache
    from specpipe.distill.train import Trainer

    data = [s for folder in (cache / "distill-data").iterdir() for s in TeacherCache(folder, {}).load()]
    student = make_student(load_causal_lm(tiny_target), layers=1, width=32, seed=0)
    budget = 0.05 * 60 * 0.5
    trainer = Trainer(student, data, budget_s=budget, lr=1e-3, batch_tokens=256, negatives=2048, prompt_weight=0.2, seed=0,
                      state_path=out / STATE_DIR / "state.pt", checkpoint_every=2)
    trainer.state.step, trainer.state.elapsed_s = 7, budget - 0.5
    trainer.save()
    result = distill(_tiny_cfg(tiny_target, out, resume=True))
    assert result.record["training"]["steps"] > 7
    assert result.record["training"]["seconds"] < budget + 5


def _cli(capsys, *args) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["distill", *args])
    return exit_info.value.code, capsys.readouterr().err


def test_bad_inputs_are_one_line_errors(tiny_target, tmp_path, capsys, cache):
    # --minutes 0
    code, err = _cli(capsys, "--target", str(tiny_target), "--out", str(tmp_path / "d"), "--minutes", "0")
    assert code == 2 and "--minutes" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1

    # a target that is not a causal LM
    from transformers import BertConfig, BertModel

    encoder = tmp_path / "encoder"
    BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(encoder)
    code, err = _cli(capsys, "--target", str(encoder), "--out", str(tmp_path / "d2"))
    assert code == 2 and "not a causal language model" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "d2").exists()

    # a non-writable --out: under a regular file, and inside /proc
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for out in (blocker / "draft", Path("/proc/specpipe-test-draft")):
        code, err = _cli(capsys, "--target", str(tiny_target), "--out", str(out))
        assert code == 2 and "not writable" in err and len(err.strip().splitlines()) == 1

    # an existing, non-empty --out without --force
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    code, err = _cli(capsys, "--target", str(tiny_target), "--out", str(existing))
    assert code == 2 and "--force" in err and (existing / "keep.txt").read_text() == "mine"

    # --resume with nothing to resume
    code, err = _cli(capsys, "--target", str(tiny_target), "--out", str(tmp_path / "new"), "--resume")
    assert code == 2 and "no saved training state" in err

    # the attention's warm start asked for without the warm start it builds on; alone, --no-warm-start is fine
    code, err = _cli(capsys, "--target", str(tiny_target), "--out", str(tmp_path / "w"), "--kind", "eagle3",
                     "--warm-attention", "--no-warm-start")
    assert code == 2 and "--warm-attention needs --warm-start" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "w").exists()


def test_training_prompts_are_disjoint_from_the_benchmark():
    from specpipe.bench.prompts import PACKAGED, read_prompt_file
    from specpipe.distill.prompts import training_prompts

    bench = {p.prompt.strip().lower() for f in PACKAGED.glob("*.jsonl") for p in read_prompt_file(f).prompts}
    train = training_prompts(0)
    assert len(train) > 500
    assert not bench & {p["prompt"].strip().lower() for p in train}
    assert {p["kind"] for p in train[:40]} == {"code", "chat"}
    assert training_prompts(0) == training_prompts(0) and training_prompts(0) != training_prompts(1)


def test_stdlib_tasks_read_as_coding_requests():
    from specpipe.distill.prompts import _DOC_VERBS, _third_person, code_prompts, stdlib_tasks

    tasks = stdlib_tasks()
    assert len(tasks) > 300 and len(set(tasks)) == len(tasks) and list(tasks) == sorted(tasks)
    verbs = {_third_person(v.lower()) for v in _DOC_VERBS}
    assert all(t.split()[0] in verbs and not t.endswith(".") and "`" not in t for t in tasks)
    assert "returns the square root of the sample variance" in tasks  # statistics.stdev's docstring
    prompts = [p for _, p in code_prompts()]
    assert all(sum(t + "." in p or t + "?" in p or t + "," in p for p in prompts) >= 2 for t in tasks[::50])


@pytest.mark.gpu
def test_distill_on_cuda_answers_and_trains_on_the_gpu(tiny_target, cache, tmp_path):
    """--device auto picks CUDA where torch sees one; both phases run there in a measured precision, and the
    draft written is an ordinary CPU-loadable checkpoint."""
    from transformers import AutoModelForCausalLM

    from specpipe.distill import distill

    result = distill(_tiny_cfg(tiny_target, tmp_path / "draft", device="auto", answer_tokens=60, train_tokens=1500,
                               minutes=10))
    record = result.record
    assert record["device"].startswith("cuda")
    probed = {name for name in record["precision"]["teacher"]["tokens_per_s"] if not name.endswith(" (run-off)")}
    assert probed == {"torch float32", "torch bfloat16", "torch float16"}  # plus a run-off's rates where probes were close
    assert record["training"]["tokens_seen"] >= 1500
    history = record["training"]["history"]
    assert not history or history[-1][2] < history[0][2] or record["training"]["steps"] < 20
    model = AutoModelForCausalLM.from_pretrained(result.path)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_cuda_asked_for_without_a_gpu_is_a_one_line_error(tiny_target, tmp_path, capsys, cache):
    if torch.cuda.is_available():
        return  # the gpu-marked test above covers a machine with one
    code, err = _cli(capsys, "--target", str(tiny_target), "--out", str(tmp_path / "d"), "--device", "cuda")
    assert code == 2 and "--device cuda" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.timing  # its curve is a ratio of times decoding took
def test_a_model_drafts_verdict_times_the_verify_calls_decoding_pays(distilled, tiny_target, tiny_tokenizer):
    """As for a head (tests/test_eagle3_head.py): given held-out prompts, a model draft's verdict decodes them with the
    target alone and with the draft's engine, and predicts with the verify calls that decoding made."""
    from specpipe.distill.verdict import DECODE_PROMPTS, measured_verdict, verdict_line
    from specpipe.engines.timing import MIN_CALLS
    from specpipe.testing.curves import curve_from_calls

    prompts = [tiny_tokenizer(text)["input_ids"] for text in
               ("def add(a, b):", "The quick brown fox", "for i in range(10):", "Once upon a time", "import os")]
    v = measured_verdict(0.5, tiny_target, threads=1, draft=distilled.path, prompts=prompts, tokenizer=tiny_tokenizer,
                         eos_token_ids=[10**6])
    decoded, timed = v["step_ms"]["decoded"], v["step_ms"]["verify_timed"]
    assert decoded["prompts"] == DECODE_PROMPTS
    calls = decoded["calls"]
    assert calls["1"][0] >= MIN_CALLS and sum(n for size, (n, _) in calls.items() if size != "1") >= MIN_CALLS
    # rel: the recorded medians are rounded to 1e-4 ms (calls_summary), ~0.1% of a tiny model's call
    assert v["step_costs"]["verify"] == pytest.approx(curve_from_calls(calls, timed), rel=3e-3)
    assert "as decoding 4 held-out prompts paid them" in verdict_line(v)


def test_verdict_says_when_it_cannot_predict(tmp_path):
    """No engine can be made (here: no checkpoint): the verdict keeps the agreement and says it cannot predict."""
    from specpipe.distill.verdict import measured_verdict, verdict_line

    v = measured_verdict(0.4, tmp_path / "missing", threads=1, draft=tmp_path / "missing-draft")
    assert v["predicted_speedup"] is None and v["cannot_predict"]
    line = verdict_line(v)
    assert line.startswith("verdict: agreement 0.40") and "cannot predict" in line and "build measures it" in line


def test_a_work_budget_lets_training_use_the_time_the_answers_left():
    """--minutes is a cap with --train-tokens: training runs to the end of it, whatever the phases before it took
    (less than their share: it gains; more: it loses, down to TRAIN_FLOOR of its share); a resumed run keeps what it
    trained. With a time budget training keeps its share whatever the answers took."""
    from specpipe.distill.config import TRAIN_FLOOR, DistillConfig

    work = DistillConfig(target="t", out="o", kind="eagle3", minutes=18, answer_tokens=80_000, train_tokens=900_000,
                         data_fraction=0.6)
    assert work.train_budget_s(240.0) == pytest.approx(18 * 60 - 240)  # answers took 4 of their 10.8 minutes
    assert work.train_budget_s(700.0) == pytest.approx(18 * 60 - 700)  # loading and the probe took 52 s over theirs
    assert work.train_budget_s(1070.0) == pytest.approx(TRAIN_FLOOR * 18 * 60 * 0.4)  # nothing left: the floor
    assert work.train_budget_s(700.0, trained_s=100.0) == pytest.approx(100 + 18 * 60 - 700)  # --resume
    timed = DistillConfig(target="t", out="o", kind="eagle3", minutes=18, data_fraction=0.6)
    assert timed.train_budget_s(240.0) == pytest.approx(18 * 60 * 0.4)
    assert timed.train_budget_s(900.0) == pytest.approx(18 * 60 * 0.4)


def test_a_work_budget_stops_the_answers_at_their_share_counted_from_the_runs_start(tiny_target, tmp_path, monkeypatch):
    """With --answer-tokens, --minutes caps the whole run: the time before the answers (loading the target, exporting
    its engines, the teacher probe) comes out of their share instead of on top of the cap, never below MIN_ANSWER_S.
    Without the run's start the answers get their whole share."""
    import time

    from specpipe.distill import teacher as teacher_module
    from specpipe.distill.progress import SilentProgress
    from specpipe.distill.run import MIN_ANSWER_S, _eos_ids, _teacher_data, open_target

    asked = []
    real = teacher_module.generate_teacher_data

    def spy(*args, budget_s, **kwargs):
        asked.append(budget_s)
        return real(*args, budget_s=budget_s, **kwargs)

    monkeypatch.setattr(teacher_module, "generate_teacher_data", spy)
    cfg = _tiny_cfg(tiny_target, tmp_path / "d", minutes=1.0, answer_tokens=30, teacher_engine="torch",
                    teacher_dtype="float32")
    share = 60 * cfg.data_fraction
    _, device, target, tokenizer, model = open_target(cfg)
    eos_ids = _eos_ids(target.path, tokenizer)
    for name, gone in (("whole", None), ("most", 0.8 * share), ("all", 2 * share)):
        monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / name))  # each run answers afresh
        started = None if gone is None else time.perf_counter() - gone
        sequences = _teacher_data(cfg, target, model, tokenizer, eos_ids, SilentProgress(), device, {}, started=started)
        assert sequences  # a batch cut short keeps its answers
    whole, most, gone_all = asked
    assert whole == pytest.approx(share)
    assert MIN_ANSWER_S <= most <= share - 0.8 * share
    assert gone_all == MIN_ANSWER_S


def test_the_learning_rate_anneals_by_whichever_budget_ends_first():
    """With a work budget (--train-tokens) and the time cap, the cosine follows whichever is further along: a run the
    cap stops at half its tokens still ends at the low rate (it used to stop at half the peak), and a fast machine
    that spends its tokens first is scheduled by them alone, as before."""
    from specpipe.distill.train import FINAL_LR_FRACTION, WARMUP_STEPS, TrainState, lr_at

    peak = 3e-3
    capped = TrainState(step=500, elapsed_s=437.0, tokens_seen=452_000)  # the Zen 3 demo: the cap hit at 452k of 900k
    assert lr_at(capped, 437.0, peak, 900_000) == pytest.approx(peak * FINAL_LR_FRACTION)
    fast = TrainState(step=500, elapsed_s=43.7, tokens_seen=450_000)  # half the tokens in a tenth of the cap
    assert lr_at(fast, 437.0, peak, 900_000) == pytest.approx(peak * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) / 2))
    assert lr_at(TrainState(step=500, elapsed_s=218.5), 437.0, peak) == lr_at(fast, 437.0, peak, 900_000)  # time only
    assert lr_at(TrainState(step=0), 437.0, peak, 900_000) == pytest.approx(peak / WARMUP_STEPS)


def test_no_verdict_times_no_engine_and_says_so(tiny_target, tmp_path, cache, monkeypatch):
    """--no-verdict (a machine that will not deploy the draft): no engine is exported or timed, and the record and the
    printed line say the speedup was not predicted here; the draft is written as usual."""
    import specpipe.distill.verdict as verdict_module
    from specpipe.distill import distill
    from specpipe.distill.verdict import NOT_TIMED, verdict_line

    def refuse(*args, **kwargs):
        raise AssertionError("timed an engine under --no-verdict")

    monkeypatch.setattr(verdict_module, "measured_verdict", refuse)
    monkeypatch.setattr(verdict_module, "export_engine", refuse)
    result = distill(_tiny_cfg(tiny_target, tmp_path / "draft", verdict=False, teacher_engine="torch",
                               teacher_dtype="float32", train_dtype="float32"))
    v = result.record["verdict"]
    assert v["predicted_speedup"] is None and v["cannot_predict"] == NOT_TIMED and 0.0 <= v["agreement"] <= 1.0
    assert "not timed here" in verdict_line(v) and "build measures it" in verdict_line(v)
    assert (result.path / "config.json").is_file() and (result.path / "distill.json").is_file()


def test_a_torch_teachers_rows_are_its_fastest_by_the_gain_rule():
    """choose_answer_rows (distill/teachers.py): going up from the fewest rows, more replace fewer only at ROWS_GAIN
    their measured tokens/s; the rates come from the measurement, every candidate timed once per round. A chooser
    that takes the plain fastest picks 144 in the first case, one that guesses (always the most, always the fewest)
    fails another."""
    from specpipe.distill.teachers import ROWS_GAIN, choose_answer_rows

    cpu = torch.device("cpu")
    cases = (({48: 375.0, 96: 475.0, 144: 490.0}, "96"), ({48: 375.0, 96: 360.0, 144: 500.0}, "144"),
             ({48: 500.0, 96: 400.0, 144: 300.0}, "48"), ({48: 100.0, 96: 100.0 * ROWS_GAIN, 144: 1.0}, "96"))
    for rates, chosen in cases:
        made = []

        def make_call(rows):
            made.append(rows)
            return lambda: rows

        def measure(calls, device):
            assert set(calls) == {f"{r} rows" for r in rates} and device == cpu
            return {name: rates[int(name.split()[0])] for name in calls}

        choice = choose_answer_rows([144, 48, 96], cpu, make_call, measure=measure)
        assert (choice.phase, choice.dtype) == ("teacher rows", chosen)
        assert choice.tokens_per_s == {f"{r} rows": rate for r, rate in rates.items()} and sorted(made) == [48, 96, 144]
    one = choose_answer_rows([8], cpu, lambda rows: pytest.fail("one candidate is not measured"))
    assert (one.dtype, one.tokens_per_s) == ("8", {})
    warmed = []
    choose_answer_rows([2, 4], cpu, lambda rows: (lambda: warmed.append(rows) or rows),
                       measure=lambda calls, device: {name: 1.0 for name in calls}, warm=False)
    assert warmed == [2], "an unwarmed teacher answers once at the fewest rows before the measurement"


def test_rows_default_by_device_and_answer_batch_fixes_them():
    from specpipe.distill.config import ANSWER_BATCH_CANDIDATES

    cpu = DistillConfig(target="t", out="o", kind="eagle3", device="cpu")
    assert cpu.answer_batches == ANSWER_BATCH_CANDIDATES["cpu"] and cpu.answer_batch == cpu.answer_batches[0]
    fixed = DistillConfig(target="t", out="o", kind="eagle3", device="cpu", answer_batch=20)
    assert (fixed.answer_batch, fixed.answer_batches) == (20, [20])
    gpu = DistillConfig(target="t", out="o", kind="eagle3", device="cuda")
    assert gpu.answer_batches == [gpu.answer_batch]
    with pytest.raises(ValueError):
        DistillConfig(target="t", out="o", device="cpu", answer_batches=[])
    with pytest.raises(ValueError) as bad:  # the error names the field given, not the candidates made from it
        DistillConfig(target="t", out="o", kind="eagle3", device="cpu", answer_batch=0)
    assert "answer_batch" in str(bad.value) and "answer_batches" not in str(bad.value)


def test_the_rows_measured_answer_the_run_and_a_second_run_reuses_them(tiny_target, cache, tmp_path, monkeypatch):
    """A torch teacher with two candidate rows: the run measures both, answers at the rule's choice (recorded in
    the draft's record and in the teacher cache's key), and a run with the same settings finds that cache without
    measuring again, whichever rows it holds."""
    from specpipe.distill import distill, teachers
    from specpipe.distill.teacher import META

    settings = dict(teacher_engine="torch", teacher_dtype="float32", answer_batches=[2, 4])
    first = distill(_tiny_cfg(tiny_target, tmp_path / "a", **settings)).record
    choice = first["precision"]["teacher rows"]
    assert set(choice["tokens_per_s"]) == {"2 rows", "4 rows"}
    rates = choice["tokens_per_s"]
    expected = "4" if rates["4 rows"] >= teachers.ROWS_GAIN * rates["2 rows"] else "2"
    assert choice["dtype"] == expected and first["data"]["answer_batch"] == int(expected)
    keys = [json.loads(p.read_text())["key"] for p in (cache / "distill-data").glob(f"*/{META}")]
    assert [k["batch"] for k in keys if k.get("source") == "answers"] == [int(expected)]

    monkeypatch.setattr(teachers, "choose_answer_rows", lambda *a, **k: pytest.fail("the cached rows are measured again"))
    second = distill(_tiny_cfg(tiny_target, tmp_path / "b", **settings)).record
    assert "teacher rows" not in second["precision"] and second["data"]["answer_batch"] == int(expected)
