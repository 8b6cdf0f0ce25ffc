"""Show a loadtest report (specpipe.bench.load): one table row per (run, concurrency), and a PNG of aggregate
tokens/s and TTFT p95 against concurrency with one line per run, so runs from several files compare at a glance."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from specpipe.bench.report import print_line, save_figure


def _fmt(value: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def print_table(report: dict, console=None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="loadtest: closed-loop streaming users", title_justify="left", box=box.SIMPLE_HEAD,
                  padding=0, pad_edge=False)  # the box's column separator is the gap
    table.add_column("run", overflow="fold", min_width=12)
    # Two-line headers (a p95 column follows its p50) so the table fits 80 columns; the JSON has the full names.
    for column in ("users", "errors", "tok/s\nall", "\nsteady", "tok/s\nreq p50", "TTFT s\np50", "\np95", "ITL ms\np50", "\np95",
                   "RSS MB\nmax", "\n+%"):
        table.add_column(column, justify="right", no_wrap=True)
    for number, run in enumerate(report["runs"]):
        if number:
            table.add_section()
        for row, level in enumerate(run["levels"]):
            rss = level["rss_mb"] or {}
            errors = f"{level['errors']}/{level['requests']}"
            table.add_row(
                "" if row else run["label"], str(level["concurrency"]), f"[red]{errors}[/]" if level["errors"] else errors,
                _fmt(level["tokens_per_s"], ".1f"), _fmt(level.get("steady_tokens_per_s"), ".1f"),
                _fmt(level["request_tokens_per_s_p50"], ".1f"),
                _fmt(level["ttft_ms_p50"], ".2f", 1e-3), _fmt(level["ttft_ms_p95"], ".2f", 1e-3),
                _fmt(level["itl_ms_p50"], ".0f"), _fmt(level["itl_ms_p95"], ".0f"),
                _fmt(rss.get("max"), ".0f"), _fmt(rss.get("growth_pct"), "+.1f") + ("%" if rss.get("growth_pct") is not None else ""),
            )
    console.print(table)
    by_label = {run["label"]: run for run in report["runs"]}
    for run in report["runs"]:
        base = by_label.get(run["label"] + " target-only")  # --against-target-only: the same server, K = 0
        if base is not None:
            ratios = [f"{level['concurrency']}: {_fmt(_ratio(level, other), '.2f')}x"
                      + (f" (drafts/token {level['drafted_per_token']:.2f}, accepted {_fmt(level['acceptance'], '.0%')})"
                         if level.get("drafted_per_token") else "")
                      for level, other in zip(run["levels"], base["levels"])]
            console.print(f"{run['label']} / target-only, steady aggregate tokens/s by users: " + ", ".join(ratios))
    for run in report["runs"]:
        settings = run["settings"]
        k = "the deployment's" if settings["num_draft_tokens"] is None else str(settings["num_draft_tokens"])
        print_line(console, f"{run['label']}: {run['target']} ({run['model']}), {settings['max_tokens']} tokens per "
                            f"request, {settings['prompts'] or settings['prompt_set']} prompts, K {k}; measured on "
                            f"{run['machine']['summary']}")
        for level in run["levels"]:
            for message, count in level["error_messages"].items():
                console.print(f"  {level['concurrency']} users, {count} x error: {message}")
            if level.get("engine_alone"):
                console.print(f"  {level['concurrency']} users: {engine_alone_line(level)}")


def engine_alone_line(level: dict) -> str:
    """The level against the served engine alone (bench/load_alone.py), in one line."""
    alone = level["engine_alone"]
    parts = []
    decode = alone.get("decode")
    if decode:
        parts.append(f"the engine alone ({alone['threads']} threads, in process) decodes {decode['rows']} rows at "
                     f"{decode['tokens_per_s']:.1f} tokens/s ({decode['step_ms']:.1f} ms a step); served steady: "
                     f"{_fmt(alone.get('served_share'), '.0%')} of it")
    burst = alone.get("burst_prefill")
    if burst and burst.get("ms"):
        parts.append(f"the burst's {burst['prompts']} prompts ({burst['prompt_tokens']} tokens) prefill alone in "
                     f"{burst['ms']:.0f} ms ({len(burst['calls'])} calls); first requests' TTFT p95 "
                     f"{_fmt(level.get('first_ttft_ms_p95'), '.0f')} ms = {_fmt(alone.get('burst_ttft_ratio'), '.2f')}x")
    return "; ".join(parts)


def _ratio(level: dict, base: dict, key: str = "steady_tokens_per_s") -> Optional[float]:
    """The two runs' ratio on the steady-state rate (every user busy), else on the whole level's."""
    if level.get(key) is None or not base.get(key):
        key = "tokens_per_s"
    if level[key] is None or not base[key]:
        return None
    return level[key] / base[key]


def plot(report: dict, path: Path) -> Path:
    """Aggregate tokens/s and TTFT p95 vs concurrency, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, (ax_tokens, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels_run = sorted({level["concurrency"] for run in report["runs"] for level in run["levels"]})
    for run in report["runs"]:
        levels = run["levels"]
        users = [level["concurrency"] for level in levels]
        ax_tokens.plot(users, [level["tokens_per_s"] for level in levels], "o-", label=run["label"])
        ax_ttft.plot(users, [_seconds(level["ttft_ms_p95"]) for level in levels], "o-", label=run["label"])
    ax_tokens.set(xlabel="concurrent users", ylabel="tokens/s, all users together", title="Aggregate throughput",
                  ylim=(0, None))
    ax_ttft.set(xlabel="concurrent users", ylabel="seconds", title="Time to first token, p95", ylim=(0, None))
    for ax in (ax_tokens, ax_ttft):
        ax.set_xscale("log", base=2)  # levels double: equal steps
        ax.set_xticks(levels_run, [str(users) for users in levels_run])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("specpipe loadtest (closed-loop streaming users)")
    return save_figure(fig, path)


def _seconds(ms: Optional[float]) -> Optional[float]:
    return None if ms is None else ms / 1e3
