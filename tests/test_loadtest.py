"""`specpipe loadtest`: its statistics on hand-made timings, the report's schema, merging reports, bad input, and one
short run against a real tritonserver serving the tiny pair."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from rich.console import Console

from specpipe.bench.load import (
    SCHEMA, LevelRun, RequestRecord, find_local_server, itl_samples, make_report, percentile, process_tree_rss,
    read_reports, summarize_level,
)
from specpipe.bench.load_report import print_table
from specpipe.triton.load import steady_tokens_per_s
from tests.test_cli_core import run_cli
from specpipe.bench.config import LoadConfig
from specpipe.errors import UsageError
from tests.test_gate import one_line_error

LEVEL_KEYS = {"concurrency", "requests", "errors", "error_messages", "wall_s", "output_tokens", "tokens_per_s",
              "steady_tokens_per_s",
              "request_tokens_per_s_p50", "ttft_ms_p50", "ttft_ms_p95", "itl_ms_p50", "itl_ms_p95", "rss_mb",
              "drafted_per_token", "acceptance", "stagger_s", "records", "first_ttft_ms_p95", "engine_alone"}
RECORD_KEYS = {"index", "stream", "sent_ms", "ttft_ms", "total_ms", "tokens", "responses", "steps", "drafted",
               "accepted", "error"}
RUN_KEYS = {"label", "target", "model", "started", "settings", "served", "machine", "levels"}


def loadtest(capsys, *args) -> tuple[int, str, str]:
    """`specpipe loadtest ARGS` through the real entry point: (exit code, stdout, stderr)."""
    return run_cli(capsys, "loadtest", *map(str, args))


# ---- statistics on hand-made timings ---------------------------------------------------------------


def test_itl_spreads_each_response_gap_over_the_tokens_it_carried():
    assert itl_samples([100.0, 140.0, 150.0], [1, 4, 1]) == [10.0] * 5
    assert itl_samples([100.0], [3]) == []  # one response: TTFT only
    assert itl_samples([], []) == []


def hand_made_level() -> LevelRun:
    """Two users, 2 s: two answered requests and one refused."""
    return LevelRun(2, [
        RequestRecord(0, 0, 0.0, total_ms=140.0, chunk_ms=[100.0, 120.0, 140.0], chunk_tokens=[1, 1, 2]),
        RequestRecord(1, 1, 0.0, total_ms=330.0, chunk_ms=[300.0, 330.0], chunk_tokens=[2, 3]),
        RequestRecord(2, 0, 140.0, total_ms=None, error="the server refused the request: queue full"),
    ], wall_s=2.0, rss_bytes=[100 * 2**20, 130 * 2**20, 105 * 2**20])


def test_level_statistics_follow_the_stated_conventions():
    row = summarize_level(hand_made_level())
    assert (row["requests"], row["errors"], row["output_tokens"]) == (3, 1, 9)
    assert row["error_messages"] == {"the server refused the request: queue full": 1}
    assert row["tokens_per_s"] == pytest.approx(9 / 2.0)  # all tokens / wall time of the level
    assert row["ttft_ms_p50"] == pytest.approx(200.0)  # the refused request is in no latency statistic
    assert row["ttft_ms_p95"] == pytest.approx(290.0)  # numpy's linear interpolation: 100 + 0.95 * 200
    # ITL samples [20, 10, 10] and [10, 10, 10]: p95 sits between the fifth (10) and sixth (20)
    assert row["itl_ms_p50"] == pytest.approx(10.0)
    assert row["itl_ms_p95"] == pytest.approx(17.5)
    assert row["request_tokens_per_s_p50"] == pytest.approx((4 / 0.14 + 5 / 0.33) / 2)
    # Both users busy from 0 ms until user 0's last request ends at 140 ms: user 0's 4 tokens, none of user 1's.
    assert row["steady_tokens_per_s"] == pytest.approx(4 / 0.14)
    assert row["rss_mb"] == {"start": 100.0, "end": 105.0, "max": 130.0, "growth_pct": pytest.approx(5.0), "samples": 3}


def test_steady_rate_counts_only_the_window_where_every_user_is_busy():
    records = [  # user 1 starts 100 ms late; user 0 stops after 400 ms
        RequestRecord(0, 0, 0.0, total_ms=200.0, chunk_ms=[50.0, 200.0], chunk_tokens=[1, 3]),  # 1 token before 100
        RequestRecord(1, 1, 100.0, total_ms=400.0, chunk_ms=[100.0, 400.0], chunk_tokens=[2, 2]),  # 2 after 400
        RequestRecord(2, 0, 200.0, total_ms=200.0, chunk_ms=[100.0, 200.0], chunk_tokens=[5, 5]),
    ]
    assert steady_tokens_per_s(records, 2) == pytest.approx((3 + 2 + 5 + 5) / 0.3)
    assert steady_tokens_per_s(records[:1], 2) is None  # a user that sent nothing: no window


def test_a_level_with_nothing_measured_reports_none_not_nan():
    row = summarize_level(LevelRun(1, [RequestRecord(0, 0, 0.0, error="boom")], wall_s=0.5))
    assert row["ttft_ms_p50"] is None and row["itl_ms_p95"] is None and row["rss_mb"] is None
    assert row["tokens_per_s"] == 0.0 and percentile([], 50) is None
    json.dumps(row, allow_nan=False)


# ---- the server's memory ---------------------------------------------------------------------------


@pytest.mark.timing
def test_process_tree_rss_counts_the_children():
    # The child says when its 64 MB are resident and lives until we close its stdin: no deadline to race.
    code = "import sys; x = bytearray(64 << 20); print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        alone = process_tree_rss(os.getpid()) - process_tree_rss(child.pid)
        assert process_tree_rss(child.pid) >= 64 << 20
        assert alone > 0  # this process's own pages, the child's counted in the tree
    finally:
        child.kill()
        child.wait()
    assert process_tree_rss(child.pid) is None


def test_find_local_server_reads_the_grpc_port_from_the_command_line(tmp_path):
    def process(pid: int, *argv: str) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")

    process(10, "/usr/bin/python", "--grpc-port=9100")
    process(11, "/opt/tritonserver/bin/tritonserver", "--model-repository=/r", "--grpc-port=9100")
    process(12, "tritonserver", "--model-repository=/r")
    assert find_local_server("127.0.0.1:9100", proc=tmp_path) == 11
    assert find_local_server("localhost:8001", proc=tmp_path) == 12  # Triton's default port
    assert find_local_server("127.0.0.1:9200", proc=tmp_path) is None
    assert find_local_server("10.1.2.3:9100", proc=tmp_path) is None  # another machine: not measurable here


# ---- reports: schema, merging, the table -----------------------------------------------------------


def fake_run(label: str, **settings) -> dict:
    from specpipe.machine import describe_machine

    level = summarize_level(hand_made_level())
    return {"label": label, "target": "triton_repo", "model": "ensemble", "started": "2025-01-01T00:00:00",
            "settings": LoadConfig(concurrency=[2], requests=3, **settings).model_dump(mode="json"), "served": {},
            "machine": describe_machine(2).as_dict(), "levels": [{**level, "records": []}]}


def test_reports_merge_from_files_and_labels_must_differ(tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(json.dumps(make_report([fake_run("one-at-a-time")])))
    two.write_text(json.dumps(make_report([fake_run("batched"), fake_run("batched K=0", num_draft_tokens=0)])))
    merged = make_report(read_reports([one, two]))
    assert merged["schema"] == SCHEMA and [r["label"] for r in merged["runs"]] == ["one-at-a-time", "batched", "batched K=0"]
    with pytest.raises(UsageError, match="labelled 'batched'"):
        make_report(read_reports([two, two]))
    (tmp_path / "other.json").write_text('{"sets": []}')
    with pytest.raises(UsageError, match="not a loadtest report"):
        read_reports([tmp_path / "other.json"])
    with pytest.raises(UsageError, match="missing.json"):
        read_reports([tmp_path / "missing.json"])

    out = io.StringIO()
    print_table(merged, Console(file=out, width=140))
    text = out.getvalue()
    assert "one-at-a-time" in text and "batched K=0" in text and "1 x error: the server refused" in text


def test_compare_alone_writes_the_merged_report_and_plot(tmp_path, capsys):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(json.dumps(make_report([fake_run("one-at-a-time")])))
    two.write_text(json.dumps(make_report([fake_run("batched")])))
    code, out, err = loadtest(capsys, "--compare", one, "--compare", two, "--json-out", tmp_path / "both.json",
                              "--plot", tmp_path / "both.png")
    assert code == 0, err
    assert [r["label"] for r in json.loads((tmp_path / "both.json").read_text())["runs"]] == ["one-at-a-time", "batched"]
    assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"
    assert "one-at-a-time" in out and "batched" in out


@pytest.mark.parametrize("args, message", [
    (["-c", "1,two", "repo"], "--concurrency '1,two': expected a list"),
    (["-c", "", "repo"], "--concurrency '': expected a list"),
    (["-c", "0,4", "repo"], "every level needs >= 1 user"),
    (["-c", "1,8", "--requests", "4", "repo"], "requests 4 < concurrency 8"),
    (["repo", "--url", "127.0.0.1:1"], "not both"),
    ([], "give TARGET"),
    (["--max-tokens", "0", "repo"], "--max-tokens"),
    (["--stream-interval", "0", "repo"], "--stream-interval"),
    (["--compare", "missing.json"], "--compare missing.json"),
    (["no-such-folder", "--warmup-requests", "0"], "no such Triton repository or engines folder"),
    (["--url", "127.0.0.1:1", "-c", "1", "--requests", "1"], "cannot reach a Triton server at 127.0.0.1:1"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    code, out, err = loadtest(capsys, *args)
    assert code == 2 and message in one_line_error(err), err


def test_a_stream_interval_for_a_repository_is_refused_before_any_load(tmp_path, capsys):
    (tmp_path / "repo").mkdir()  # no manifest.json: a repository, whose config.pbtxt decides
    code, _, err = loadtest(capsys, tmp_path / "repo", "--stream-interval", "2", "--warmup-requests", "0")
    assert code == 2 and "--stream-interval applies to a built deployment" in one_line_error(err), err


def test_a_label_clash_fails_before_any_load(tmp_path, capsys):
    one = tmp_path / "one.json"
    one.write_text(json.dumps(make_report([fake_run("same")])))
    code, _, err = loadtest(capsys, "--url", "127.0.0.1:1", "--label", "same", "--compare", one)
    assert code == 2 and "labelled 'same'" in one_line_error(err)


# ---- a real server ---------------------------------------------------------------------------------


def test_real_server_at_one_and_two_users(tiny_self_build, tmp_path, capsys):
    """engines/NAME as TARGET: a temporary repository beside it, tritonserver on free ports, stopped after; every
    level run as deployed and with K = 0 in each request, on the same server; users' first requests staggered."""
    before = set(tiny_self_build.parent.iterdir())
    code, out, err = loadtest(capsys, tiny_self_build, "-c", "1,2", "--requests", "4", "--warmup-requests", "1",
                              "--max-tokens", "8", "--label", "tiny", "--against-target-only", "--stream-interval", "3",
                              "--json-out", tmp_path / "load.json", "--plot", tmp_path / "load.png")
    assert code == 0, err
    assert set(tiny_self_build.parent.iterdir()) == before  # the temporary repository is gone

    report = json.loads((tmp_path / "load.json").read_text())
    assert report["schema"] == SCHEMA and [run["label"] for run in report["runs"]] == ["tiny", "tiny target-only"]
    deployed, target_only = report["runs"]
    assert target_only["settings"]["num_draft_tokens"] == 0 and deployed["settings"]["num_draft_tokens"] is None
    for run in report["runs"]:
        assert set(run) == RUN_KEYS and run["served"]["instances"] == 1 and run["served"]["stream_interval"] == 3
        assert run["settings"]["concurrency"] == [1, 2] and run["machine"]["summary"]
        for level, users in zip(run["levels"], (1, 2)):
            assert set(level) == LEVEL_KEYS and level["concurrency"] == users
            assert (level["requests"], level["errors"]) == (4, 0), level["error_messages"]
            assert level["output_tokens"] == 4 * 8  # EOS ignored: every request makes max_tokens
            assert all(set(r) == RECORD_KEYS and r["tokens"] == 8 and r["ttft_ms"] <= r["total_ms"] for r in level["records"])
            assert {r["stream"] for r in level["records"]} == set(range(users))
            assert 0 < level["ttft_ms_p50"] <= level["ttft_ms_p95"] and level["itl_ms_p50"] is not None
            assert level["rss_mb"]["start"] > 50 and level["rss_mb"]["samples"] >= 2  # server and stub together
            # Staggered: the second user's first request leaves half a warm-up request's latency after the first.
            assert level["stagger_s"] > 0
            first_sent = min(r["sent_ms"] for r in level["records"] if r["stream"] == users - 1)
            assert first_sent >= 0.9 * 1e3 * level["stagger_s"] * (users - 1) / users
            # The engine alone beside the level: its decode rate at the level's rows, and no burst to compare.
            alone = level["engine_alone"]
            assert alone["decode"]["rows"] == users and alone["decode"]["steps"] == 8 - 1
            assert alone["decode"]["tokens_per_s"] > 0 and alone["served_share"] > 0
            assert "burst_prefill" not in alone and alone["threads"] >= 1
    # The server reports each request's drafts; with K = 0 in the request no row drafts. (As deployed, this pair
    # does not speculate either: the target as its own draft costs a target step per draft token, c = 1.)
    assert all(r["drafted"] is not None for run in report["runs"] for level in run["levels"] for r in level["records"])
    assert all(level["drafted_per_token"] == 0 and level["acceptance"] is None for level in target_only["levels"])
    assert (tmp_path / "load.png").is_file() and "tiny target-only" in out


@pytest.mark.timing
def test_a_burst_level_reports_its_prefill_alone_and_the_first_requests_ttft_over_it(tiny_self_build, tmp_path, capsys):
    """--arrivals burst: after the level, the same first prompts (as the server encodes them) prefilled alone by the
    served scheduler's own rule in this process; the row has the ratio, the table says it."""
    code, out, err = loadtest(capsys, tiny_self_build, "-c", "3", "--requests", "6", "--warmup-requests", "1",
                              "--max-tokens", "4", "--arrivals", "burst", "--json-out", tmp_path / "load.json")
    assert code == 0, err
    [run] = json.loads((tmp_path / "load.json").read_text())["runs"]
    [level] = run["levels"]
    burst = level["engine_alone"]["burst_prefill"]
    assert burst["prompts"] == 3 and burst["ms"] > 0 and len(burst["runs_ms"]) == level["engine_alone"]["runs"]
    assert sum(tokens for _, _, tokens in burst["calls"]) == burst["prompt_tokens"]
    first = [r["ttft_ms"] for r in level["records"] if r["index"] < 3]  # each user's first request: the burst
    assert level["first_ttft_ms_p95"] == pytest.approx(percentile(first, 95))
    assert level["engine_alone"]["burst_ttft_ratio"] == pytest.approx(level["first_ttft_ms_p95"] / burst["ms"])
    assert "prefill alone in" in " ".join(out.split())


def test_requests_ask_for_perf_metrics_only_when_told():
    """Each streamed token's response carries 10 perf tensors more when asked; the loadtest reads none of them."""
    from specpipe.bench.load import request_tensors

    assert not request_tensors("def f():", LoadConfig())["return_perf_metrics"].item()
    assert request_tensors("def f():", LoadConfig(perf_metrics=True))["return_perf_metrics"].item()


def test_against_target_only_sends_k_0_in_one_variant_and_alternates_which_goes_first(monkeypatch):
    import specpipe.bench.load as load

    calls = []

    def fake_level(url, model_name, make_request, concurrency, requests, **kwargs):
        calls.append((concurrency, make_request(0).get("num_draft_tokens"), kwargs.get("stagger_s", 0.0)))
        record = RequestRecord(0, 0, 0.0, total_ms=1500.0, chunk_ms=[100.0, 1500.0], chunk_tokens=[1, 7])
        return LevelRun(concurrency, [record] * requests, wall_s=1.0)

    monkeypatch.setattr(load, "run_level", fake_level)
    cfg = LoadConfig(concurrency=[1, 2, 4], requests=4, warmup_requests=1, against_target_only=True)
    rows = load.run_load(cfg, "127.0.0.1:1", model_name="m")
    k0 = [[0]]
    assert [(c, None if k is None else k.tolist()) for c, k, _ in calls] == [
        (1, None),  # warm-up, as deployed
        (1, None), (1, k0), (1, k0), (1, None),  # each level in halves, A B B A; the first alternates
        (2, k0), (2, None), (2, None), (2, k0),
        (4, None), (4, k0), (4, k0), (4, None)]
    assert all(stagger == 1.5 for _, _, stagger in calls[1:])  # the warm-up request's latency
    assert [row["concurrency"] for row in rows[load.TARGET_ONLY]] == [1, 2, 4] == [row["concurrency"] for row in rows[""]]
    assert all(row["requests"] == 4 and len(row["records"]) == 4 for run in rows.values() for row in run)
    calls.clear()
    load.run_load(cfg.model_copy(update={"arrivals": "burst"}), "127.0.0.1:1", model_name="m")
    assert all(stagger == 0.0 for _, _, stagger in calls)


def test_a_gate_whose_latency_slo_has_fewer_requests_than_users_is_refused(tmp_path):
    from specpipe.errors import GateError
    from specpipe.gate import load_gate

    gate_file = tmp_path / "gate.toml"
    gate_file.write_text("[latency]\nconcurrency = 4\nrequests = 2\n")
    with pytest.raises(GateError, match="requests 2 < concurrency 4"):
        load_gate(gate_file)
    gate_file.write_text("[latency]\nconcurrency = 4\nrequests = 4\n")
    assert load_gate(gate_file).latency.concurrency == 4


def test_a_level_run_in_halves_counts_every_request_and_averages_the_halves_steady_rates():
    from specpipe.bench.load import summarize_parts
    from specpipe.triton.load import summarize_level

    def half(seconds_per_request):  # 2 users, 2 requests each, back to back; 10 tokens a request
        records = [RequestRecord(2 * i + s, s, i * seconds_per_request * 1e3, total_ms=seconds_per_request * 1e3,
                                 chunk_ms=[50.0, seconds_per_request * 1e3], chunk_tokens=[1, 9])
                   for i in range(2) for s in range(2)]
        return LevelRun(2, records, wall_s=2 * seconds_per_request)

    fast, slow = half(1.0), half(2.0)
    row = summarize_parts([fast, slow])
    assert row["requests"] == 8 and row["output_tokens"] == 80
    assert row["tokens_per_s"] == pytest.approx(80 / 6.0)
    steady = [summarize_level(p)["steady_tokens_per_s"] for p in (fast, slow)]
    assert None not in steady and steady[0] == pytest.approx(2 * steady[1])
    assert row["steady_tokens_per_s"] == pytest.approx((steady[0] + steady[1]) / 2)
    assert summarize_parts([fast]) == summarize_level(fast)


def test_each_user_sends_its_own_share_however_late_it_starts(monkeypatch):
    """A level of c users is c users: user n sends requests n, n + c, ... A late user (staggered, or slow to start on
    a loaded machine) still sends its share; with a shared queue the first user drained all of them here."""
    import specpipe.triton.client as client_module
    from specpipe.triton.load import run_level

    class InstantGeneration:  # the server's side, answered at once: user 0 is done before user 1 wakes
        def __init__(self, url, tensors, **kwargs):
            self.result = None

        def __iter__(self):
            self.result = {"total_ms": 1.0, "chunk_ms": [1.0], "chunk_tokens": [1]}
            return iter(["x"])

    monkeypatch.setattr(client_module, "RemoteGeneration", InstantGeneration)
    level = run_level("127.0.0.1:1", "m", lambda index: {}, concurrency=2, requests=5, stagger_s=0.4)
    assert [(r.index, r.stream) for r in level.records] == [(0, 0), (1, 1), (2, 0), (3, 1), (4, 0)]
    assert all(r.error is None for r in level.records)
