"""`specpipe bench` on tiny pairs: the JSON has every field, the numbers obey their conventions, bad inputs."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from specpipe.bench.harness import BASELINE, Measurement, summarize
from specpipe.bench.report import print_line, print_tables
from specpipe.cli import main


@pytest.fixture(scope="module")
def engines(tiny_target, tiny_draft, tmp_path_factory):
    """Two deployments: target + unrelated random draft, and target + itself (acceptance must be 1)."""
    from specpipe.builder import build
    from specpipe.builder.config import BuildConfig

    root = tmp_path_factory.mktemp("bench-engines")
    pair = build(BuildConfig(target=str(tiny_target), draft=str(tiny_draft), name="pair", engines_dir=root, repo_dir=None))
    self_pair = build(BuildConfig(target=str(tiny_target), draft=str(tiny_target), name="self", engines_dir=root,
                                  repo_dir=None))
    return pair, self_pair


def _bench(capsys, *args) -> dict:
    try:
        main(["bench", *args, "--json"])
    except SystemExit as exit_info:
        assert exit_info.code in (0, None)
    return json.loads(capsys.readouterr().out)


def test_bench_json_has_every_field(engines, capsys, tmp_path):
    pair, _ = engines
    plot = tmp_path / "bench.png"
    results = _bench(capsys, str(pair), "--prompts-set", "code", "--prompts-set", "chat", "-k", "1..2",
                             "--max-new-tokens", "6", "--max-prompts", "2", "--plot", str(plot),
                             "--json-out", str(tmp_path / "bench.json"))
    assert json.loads((tmp_path / "bench.json").read_text())["sets"] == results["sets"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [s["name"] for s in results["sets"]] == ["code", "chat"]
    for prompt_set in results["sets"]:
        labels = [row["label"] for row in prompt_set["rows"]]
        assert labels == [BASELINE, "K=1", "K=2", "adaptive", "hf target-only", "hf K=1", "hf K=2", "hf assisted",
                          "hf prompt-lookup"]
        for row in prompt_set["rows"]:
            for key in ("tokens_per_s", "ttft_ms", "acceptance_rate", "mean_accepted_len", "speedup", "ms_per_token",
                        "matches_target", "prompts", "copied_share", "copied_acceptance", "speedup_ci95",
                        "speedup_of_medians"):
                assert key in row
            assert row["tokens_per_s"] > 0 and row["ttft_ms"] > 0 and row["prompts"] == 2
        rows = {row["label"]: row for row in prompt_set["rows"]}
        assert rows[BASELINE]["speedup"] == pytest.approx(1.0)
        # Greedy speculative decoding is lossless: every speculative row reproduces the target's tokens.
        assert all(rows[label]["matches_target"] == 2 for label in ("K=1", "K=2", "adaptive"))
        assert 0.0 <= rows["K=2"]["acceptance_rate"] <= 1.0
        assert rows["K=2"]["copied_share"] == 0.0  # a model draft: prompt lookup copies inside a head's steps only
        assert 1.0 <= rows["K=2"]["mean_accepted_len"] <= 3.0
        assert rows["hf assisted"]["acceptance_rate"] is None  # transformers does not report it
        assert len(prompt_set["per_prompt"]["K=1"]) == 2
        assert prompt_set["best"]["k"] in (1, 2)
        ceiling = prompt_set["copy_ceiling"]
        assert len(ceiling["per_prompt"]) == 2 and all(1.0 <= c <= 6 for c in ceiling["per_prompt"])
        assert min(ceiling["per_prompt"]) <= ceiling["tokens_per_call_median"] <= max(ceiling["per_prompt"])
    limit = results["physical_limit"]
    assert limit["bandwidth_gb_s"] > 0.1 and limit["target_weight_bytes"] > 0
    assert limit["target_floor_ms_per_token"] > 0 and limit["target_measured_ms_per_token"] > 0
    low, high = limit["bandwidth_gb_s_range"]
    assert low <= limit["bandwidth_gb_s"] <= high and len(limit["rounds"]) == 8
    s_low, s_high = limit["target_step_vs_floor_range"]
    assert 0 < s_low <= limit["target_step_vs_floor"] <= s_high
    assert results["step_costs_ms"]["draft_decode"] > 0
    manifest = json.loads((pair / "manifest.json").read_text())
    assert results["adaptive_costs"] == manifest["step_costs"]
    # Where the numbers come from: the bench run's machine, and the build's (where step costs were measured).
    for machine in (results["machine"], manifest["machine"]):
        assert machine["summary"] and machine["threads"]["in_use"] == 2
        assert set(machine["isa"]) >= {"avx2", "avx512f", "avx512_bf16", "amx_tile"} and machine["versions"]["torch"]
    printed = io.StringIO()
    print_tables(results, Console(file=printed, width=100))
    assert printed.getvalue().startswith(f"measured on: {results['machine']['summary']}\n")
    assert "95% interval over these prompts: K=1 " in " ".join(printed.getvalue().split())  # rich wraps at 100


def test_self_draft_is_always_accepted(engines, capsys):
    """Draft == target: every drafted token is accepted, so a K-token step emits K + 1 tokens."""
    _, self_pair = engines
    results = _bench(capsys, str(self_pair), "--prompts-set", "code", "-k", "3", "--max-new-tokens", "9",
                             "--max-prompts", "2", "--no-peer", "--no-adaptive", "--warmup-prompts", "0")
    rows = {row["label"]: row for row in results["sets"][0]["rows"]}
    assert list(rows) == [BASELINE, "K=3"]
    assert rows["K=3"]["acceptance_rate"] == 1.0
    generated = sum(m["num_generated"] for m in results["sets"][0]["per_prompt"]["K=3"])
    if generated == 2 * 9:  # no early EOS: 9 tokens = two full 4-token steps + one final step
        assert rows["K=3"]["mean_accepted_len"] == pytest.approx(9 / 3)


def test_rounds_through_the_cli(engines, capsys):
    """`--rounds 2`: every row runs each prompt twice, the JSON counts prompts and runs apart, and the report prints each
    round's speedup."""
    _, self_pair = engines
    results = _bench(capsys, str(self_pair), "--prompts-set", "code", "-k", "1", "--max-new-tokens", "4",
                     "--max-prompts", "2", "--no-peer", "--no-adaptive", "--warmup-prompts", "0", "--rounds", "2")
    prompt_set = results["sets"][0]
    rows = {row["label"]: row for row in prompt_set["rows"]}
    assert (rows["K=1"]["prompts"], rows["K=1"]["runs"], rows["K=1"]["rounds"]) == (2, 4, 2)
    assert rows["K=1"]["matches_target"] == 4 and len(rows["K=1"]["speedup_by_round"]) == 2
    assert [m["round"] for m in prompt_set["per_prompt"]["K=1"]] == [0, 0, 1, 1]
    assert results["settings"]["rounds"] == 2
    printed = io.StringIO()
    print_tables(results, Console(file=printed, width=200))
    assert "speedup in each round" in printed.getvalue() and "4/4" in printed.getvalue()


def test_each_step_is_judged_against_its_own_rounds_bandwidth():
    """The floor's bandwidth drifts (limits.py): readings alternate between two machine states, 30 and 50 GB/s, and
    the decode step follows the state it ran in, at 1.2x its floor in both. Paired, every round reads 1.2x; a
    floor taken once (or from the median) would read 0.9-1.5x."""
    from specpipe.bench.limits import paired_floor

    weight = 300_000_000  # bytes a token: 10 ms at 30 GB/s, 6 ms at 50
    states = iter([30e9, 50e9] * 4)
    current = {}

    def bandwidth() -> float:
        current["bytes_per_s"] = next(states)
        return current["bytes_per_s"]

    out = paired_floor(lambda: 1.2 * weight / current["bytes_per_s"] * 1e3, weight, rounds=8, bandwidth=bandwidth)
    assert [r["bandwidth_gb_s"] for r in out["rounds"]] == [30.0, 50.0] * 4
    assert out["step_vs_floor"] == pytest.approx(1.2)
    assert out["step_vs_floor_min"] == pytest.approx(1.2) and out["step_vs_floor_max"] == pytest.approx(1.2)
    assert (out["bandwidth_gb_s_min"], out["bandwidth_gb_s"], out["bandwidth_gb_s_max"]) == (30.0, 40.0, 50.0)
    assert out["floor_ms_per_token"] == pytest.approx(7.5)  # at the median bandwidth


def test_the_machine_line_is_one_line_at_any_width():
    """A CPU with AVX-512 and AMX names ten ISA flags: the line stays whole (a planted console.print wraps it at
    the console's width) and brackets in a CPU's name print as they are (rich would read them as markup)."""
    summary = ("Intel Xeon [sim] (AVX2, FMA, AVX-512F, AVX512-VNNI, AVX512-BF16, AMX-TILE, AMX-BF16, AVX-VNNI), "
               "2 cores, 2 threads")
    printed = io.StringIO()
    print_line(Console(file=printed, width=40), f"measured on: {summary}")
    assert printed.getvalue() == f"measured on: {summary}\n"


def test_summary_conventions():
    """Pooled acceptance, bonus-inclusive mean accepted length, speedup paired by prompt (both prompts twice as fast,
    so every estimator agrees here; the next test tells them apart)."""
    base = [Measurement("a", 10, 1000.0, 100.0, token_ids=[1] * 10), Measurement("b", 10, 2000.0, 100.0, token_ids=[2] * 10)]
    spec = [Measurement("a", 10, 500.0, 50.0, drafted=8, accepted=6, steps=4, emitted=10, token_ids=[1] * 10),
            Measurement("b", 10, 1000.0, 50.0, drafted=12, accepted=4, steps=6, emitted=10, token_ids=[9] * 10)]
    row = summarize("K=2", "speculative", 2, spec, base)
    assert row["acceptance_rate"] == pytest.approx(10 / 20)
    assert row["mean_accepted_len"] == pytest.approx(20 / 10)
    assert row["tokens_per_s"] == pytest.approx(15.0)  # median of 20 and 10 tok/s
    assert row["speedup"] == pytest.approx(15.0 / 7.5) and row["speedup_of_medians"] == pytest.approx(15.0 / 7.5)
    assert row["speedup_ci95"] == pytest.approx([2.0, 2.0])
    assert row["matches_target"] == 1
    assert row["ms_per_token"] == pytest.approx((450 / 9 + 950 / 9) / 2)


def test_speedup_pairs_each_prompt_with_its_own_target_only_run():
    """Each prompt's two runs ran back to back, so a spell of the machine or a prompt's own rate hits both sides of its
    ratio; the speedup is the geometric mean of those ratios, paired by prompt id (not by list order), with a t
    interval on the log ratios. The unpaired ratio of medians (kept as speedup_of_medians) is another figure."""
    from specpipe.bench.harness import paired_speedup

    def run(pid, tps):
        return Measurement(pid, 30, 30 / tps * 1e3, 10.0)

    base = [run("a", 20.0), run("b", 10.0), run("c", 8.0)]
    spec = [run("c", 12.0), run("a", 30.0), run("b", 15.0)]  # each 1.5x its own, in another order
    row = summarize("adaptive", "speculative", None, spec, base)
    assert row["speedup"] == pytest.approx(1.5) and row["speedup_ci95"] == pytest.approx([1.5, 1.5])
    assert row["speedup_per_prompt_median"] == pytest.approx(1.5)

    spec = [run("a", 24.0), run("b", 15.0), run("c", 14.4)]  # 1.2x, 1.5x, 1.8x
    row = summarize("adaptive", "speculative", None, spec, base)
    assert row["speedup"] == pytest.approx((1.2 * 1.5 * 1.8) ** (1 / 3))
    assert row["speedup_of_medians"] == pytest.approx(15.0 / 10.0)

    # Ratios that differ: the geometric mean, inside a t interval on the logs (scipy.stats), wider with more spread
    mean, (low, high) = paired_speedup([1.2, 1.5, 1.8])
    assert mean == pytest.approx((1.2 * 1.5 * 1.8) ** (1 / 3))
    import math

    from scipy import stats

    logs = [math.log(x) for x in (1.2, 1.5, 1.8)]
    half = stats.t.ppf(0.975, 2) * stats.sem(logs)
    assert (low, high) == pytest.approx((mean * math.exp(-half), mean * math.exp(half)))
    _, (low2, high2) = paired_speedup([1.4, 1.5, 1.6])
    assert low < low2 < high2 < high
    assert paired_speedup([1.3]) == (pytest.approx(1.3), None) and paired_speedup([]) == (None, None)


def test_bad_inputs(engines, tmp_path, capsys):
    pair, _ = engines

    def fails(*args) -> str:
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err
        return err

    assert "not a built deployment" in fails(str(tmp_path))
    assert "K must be >= 1" in fails(str(pair), "-k", "0..2")
    assert "-k" in fails(str(pair), "-k", "one")
    assert "K <= 8" in fails(str(pair), "-k", "9", "--no-peer")
    assert "rounds" in fails(str(pair), "--rounds", "0", "--no-peer")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    assert "prompt" in fails(str(pair), "--prompts", str(bad))


class _RecordingRow:
    """A bench row that records (its label, the prompt's first id) for each run and times nothing."""
    kind, k, strategy, peer = "target-only", None, "target-only", None

    def __init__(self, label, calls):
        self.label, self.calls = label, calls

    def run(self, prompt_ids, max_new_tokens):
        self.calls.append((self.label, prompt_ids[0]))
        return Measurement(prompt_id="", num_generated=1, total_ms=1.0, ttft_ms=1.0)


def _recording_rows(labels, calls):
    return [_RecordingRow(label, calls) for label in labels]


def test_run_rows_rotates_which_row_runs_first_and_keeps_prompt_order():
    """Prompt i starts with row i mod n, so no row always runs right after the same neighbour (bench/harness.py
    run_rows); each row's measurements stay in prompt order."""
    from specpipe.bench.harness import run_rows

    calls = []
    rows = _recording_rows("abc", calls)
    results = run_rows(rows, [(f"p{i}", [i]) for i in range(4)], max_new_tokens=8, warmup=[])
    firsts = [calls[3 * i] for i in range(4)]
    assert firsts == [("a", 0), ("b", 1), ("c", 2), ("a", 3)]
    assert calls[3:6] == [("b", 1), ("c", 1), ("a", 1)]
    assert [m.prompt_id for m in results["c"]] == ["p0", "p1", "p2", "p3"]


def test_rounds_run_every_prompt_again_and_rotate_the_first_row():
    """`bench --rounds 2`: the prompts run round after round, each measurement names its round, and a prompt's second
    round starts with another row than its first (the turn counts on across rounds)."""
    from specpipe.bench.harness import run_rows

    calls = []
    rows = _recording_rows("ab", calls)
    results = run_rows(rows, [("p0", [0]), ("p1", [1]), ("p2", [2])], max_new_tokens=8, warmup=[], rounds=2)
    assert [(m.prompt_id, m.round) for m in results["b"]] == [("p0", 0), ("p1", 0), ("p2", 0),
                                                                ("p0", 1), ("p1", 1), ("p2", 1)]
    firsts = [calls[2 * i] for i in range(6)]
    assert firsts == [("a", 0), ("b", 1), ("a", 2), ("b", 0), ("a", 1), ("b", 2)]
    assert len(calls) == 12


def test_rounds_average_within_a_prompt_and_the_interval_stays_over_prompts():
    """A prompt measured in two rounds gives one ratio, the geometric mean of its rounds' (here 1.2 and 1.8 on prompt a:
    sqrt(2.16)); the interval is Student's t over the prompts' ratios (3 of them, not 6 runs, which would narrow it),
    and speedup_by_round is each round's own paired speedup."""
    import math

    from specpipe.bench.harness import paired_speedup

    def run(pid, rnd, tps):
        return Measurement(pid, 30, 30 / tps * 1e3, 10.0, round=rnd, token_ids=[1] * 30)

    base = [run(p, r, 10.0) for r in (0, 1) for p in "abc"]
    spec = [run("a", 0, 12.0), run("b", 0, 15.0), run("c", 0, 14.0),
            run("a", 1, 18.0), run("b", 1, 15.0), run("c", 1, 16.0)]
    row = summarize("adaptive", "speculative", None, spec, base)
    per_prompt = [math.sqrt(1.2 * 1.8), math.sqrt(1.5 * 1.5), math.sqrt(1.4 * 1.6)]
    mean, ci = paired_speedup(per_prompt)
    assert row["speedup"] == pytest.approx(mean) and row["speedup_ci95"] == pytest.approx(ci)
    assert row["speedup_ci95"] != pytest.approx(paired_speedup([1.2, 1.5, 1.4, 1.8, 1.5, 1.6])[1])
    assert row["speedup_by_round"] == pytest.approx([(1.2 * 1.5 * 1.4) ** (1 / 3), (1.8 * 1.5 * 1.6) ** (1 / 3)])
    assert (row["prompts"], row["runs"], row["rounds"], row["matches_target"]) == (3, 6, 2, 6)

    # Paired by round too: round 1's baseline slower for prompt a (a slow spell) moves only that round's ratio.
    base[3] = run("a", 1, 9.0)
    row = summarize("adaptive", "speculative", None, spec, base)
    assert row["speedup_by_round"][0] == pytest.approx((1.2 * 1.5 * 1.4) ** (1 / 3))
    assert row["speedup_by_round"][1] == pytest.approx((2.0 * 1.5 * 1.6) ** (1 / 3))
    one_round = summarize("adaptive", "speculative", None, spec[:3], base[:3])
    assert one_round["speedup_by_round"] is None and one_round["rounds"] == 1
