"""Show bench results: a rich table per prompt set, and a PNG plot of speedup and acceptance vs K."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_tables(results: dict, console=None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    console.print(f"measured on: {results['machine']['summary']}")
    for s in results["sets"]:
        table = Table(title=f"{s['name']}: {s['prompts']} prompts, {results['settings']['max_new_tokens']} new tokens, "
                            f"greedy, {results['settings']['threads']} threads", title_justify="left",
                      box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
        # Short headers so the table fits 80 columns; the JSON output has the full names.
        table.add_column("row", no_wrap=True)
        for column in ("tok/s", "speedup", "TTFT ms", "ms/tok", "accept", "acc.len", "draft%", "=target"):
            table.add_column(column, justify="right", min_width=len(column))
        for row in s["rows"]:
            best = s["best"] and row["k"] == s["best"]["k"] and row["kind"] == "speculative"
            table.add_row(
                f"[bold]{row['label']}[/]" if best else row["label"],
                _fmt(row["tokens_per_s"], ".1f"),
                _fmt(row["speedup"], ".2f") + ("x" if row["speedup"] is not None else ""),
                _fmt(row["ttft_ms"], ".0f"),
                _fmt(row["ms_per_token"], ".1f"),
                _fmt(row["acceptance_rate"], ".3f") if row["kind"] == "speculative" else "-",
                _fmt(row["mean_accepted_len"], ".2f") if row["kind"] == "speculative" else "-",
                _fmt(row["draft_ms_share"] and 100 * row["draft_ms_share"], ".0f") + ("%" if row["draft_ms_share"] else ""),
                "-" if row["matches_target"] is None else f"{row['matches_target']}/{row['prompts']}",
            )
        console.print(table)
        ceiling = (s.get("copy_ceiling") or {}).get("tokens_per_call_median")
        if ceiling is not None:
            console.print(f"copy ceiling: the best possible prompt-lookup drafter emits {ceiling:.2f} tokens per target "
                          f"call (median over prompts): its speedup bound with free verification")
    limit = results["physical_limit"]
    costs = results["step_costs_ms"]
    console.print(
        f"physical limit: {limit['target_weight_bytes'] / 1e6:.0f} MB of target weights per token / "
        f"{limit['bandwidth_gb_s']:.1f} GB/s (fp32 matrix-vector) = {limit['target_floor_ms_per_token']:.1f} ms/token floor; "
        f"measured target-only {_fmt(limit['target_measured_ms_per_token'], '.1f')} ms/token "
        f"({_fmt(limit['target_measured_vs_floor'], '.1f')}x the floor)"
    )
    line = f"engine steps (64-token cache): target decode {costs['target_decode']:.1f} ms, verify K=4 " \
           f"{costs['target_verify_k4']:.1f} ms ({costs['verify_k4_vs_decode']:.2f}x)"
    if "draft_decode" in costs:
        line += f", draft decode {costs['draft_decode']:.2f} ms ({costs['draft_vs_target']:.3f}x the target)"
    console.print(line)
    if results.get("peer_note"):
        console.print(f"peer rows skipped: {results['peer_note']}")


def plot(results: dict, path: Path) -> Path:
    """Speedup and acceptance rate vs K per prompt set; adaptive and peer rows as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_accept) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, s in enumerate(results["sets"]):
        color = f"C{index}"
        fixed = sorted((r for r in s["rows"] if r["kind"] == "speculative" and r["k"] is not None), key=lambda r: r["k"])
        ks = [r["k"] for r in fixed]
        ax_speed.plot(ks, [r["speedup"] for r in fixed], "o-", color=color, label=f"{s['name']}: fixed K")
        ax_accept.plot(ks, [r["acceptance_rate"] for r in fixed], "o-", color=color, label=f"{s['name']}: fixed K")
        for r, style in ((_row(s, "adaptive"), "--"), (_row(s, "hf assisted"), ":")):
            if r and r["speedup"] is not None:
                ax_speed.axhline(r["speedup"], linestyle=style, color=color, label=f"{s['name']}: {r['label']}")
            if r and r["acceptance_rate"] is not None:
                ax_accept.axhline(r["acceptance_rate"], linestyle=style, color=color, label=f"{s['name']}: {r['label']}")
    ax_speed.axhline(1.0, color="grey", linewidth=0.8)
    ax_speed.set(xlabel="K (tokens drafted per step)", ylabel="speedup vs target-only (tokens/s)", title="Speedup")
    ax_accept.set(xlabel="K (tokens drafted per step)", ylabel="accepted / drafted", title="Acceptance rate", ylim=(0, 1))
    for ax in (ax_speed, ax_accept):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"specpipe bench {results['engine_dir']} ({results['settings']['max_new_tokens']} new tokens, greedy)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _row(prompt_set: dict, label: str) -> Optional[dict]:
    return next((r for r in prompt_set["rows"] if r["label"] == label), None)
