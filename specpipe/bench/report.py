"""Show bench results: a rich table per prompt set (specpipe's rows, then each peer's), and a PNG plot."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_line(console, text: str) -> None:
    """One record, one line, whatever the console's width: the machine line names ~10 ISA flags on a CPU with AVX-512
    and AMX, and scripts and readers find it by its start; rich would wrap it and read brackets in it as markup."""
    console.print(text, soft_wrap=True, markup=False, highlight=False)


def print_tables(results: dict, console=None) -> None:
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    print_line(console, f"measured on: {results['machine']['summary']}")
    for s in results["sets"]:
        table = Table(title=f"{s['name']}: {s['prompts']} prompts, {results['settings']['max_new_tokens']} new tokens, "
                            f"greedy, {results['settings']['threads']} threads", title_justify="left",
                      box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False, show_edge=False)
        # Short headers so the table fits 80 columns; the JSON output has the full names. Each peer's rows follow
        # a line naming it. speedup: vs the row's own engine alone; vs sp: vs specpipe's row of the same strategy
        # and K; =target: prompts whose ids equal the row's own engine's target-only ids.
        table.add_column("row", no_wrap=True)
        for column in ("tok/s", "speedup", "vs sp", "TTFT ms", "ms/tok", "accept", "acc.len", "draft%", "=target"):
            table.add_column(column, justify="right", min_width=len(column))
        named = any(row.get("peer") for row in s["rows"])  # name each engine above its rows when peers ran
        engine = None if not named else ""
        for row in s["rows"]:
            peer = row.get("peer")
            if peer != engine:
                engine = peer
                table.add_section()
                table.add_row(f"[bold]{escape(peer or 'specpipe')}[/] {escape(str(row.get('precision') or ''))}")
            best = s["best"] and row["k"] == s["best"]["k"] and row["kind"] == "speculative"
            label = escape(row["label"].removeprefix(f"{peer} ") if peer else row["label"])
            label = f" {label}" if named else label
            speedup = row.get("own_speedup") if peer else row["speedup"]
            matches = "-" if row["matches_target"] is None else f"{row['matches_target']}/{row.get('runs', row['prompts'])}"
            table.add_row(
                f"[bold]{label}[/]" if best else label,
                _fmt(row["tokens_per_s"], ".1f"),
                _fmt(speedup, ".2f") + ("x" if speedup is not None else ""),
                _fmt(row.get("vs_specpipe"), ".2f") + ("x" if row.get("vs_specpipe") is not None else ""),
                _fmt(row["ttft_ms"], ".0f"),
                _fmt(row["ms_per_token"], ".1f"),
                _fmt(row["acceptance_rate"], ".3f") if row["strategy"] != "target-only" else "-",
                _fmt(row["mean_accepted_len"], ".2f") if row["strategy"] != "target-only" else "-",
                _fmt(row["draft_ms_share"] and 100 * row["draft_ms_share"], ".0f") + ("%" if row["draft_ms_share"] else ""),
                matches if not row.get("mismatches") else f"[red]{matches}[/]",
            )
        console.print(table)
        spread = [(row["label"], row.get("own_speedup_ci95") if row.get("peer") else row.get("speedup_ci95"))
                  for row in s["rows"] if row["strategy"] != "target-only"]
        if any(ci for _, ci in spread):
            console.print("speedup: each prompt against its own target-only run, geometric mean; 95% interval over these "
                          "prompts: " + ", ".join(f"{escape(label)} {ci[0]:.2f}-{ci[1]:.2f}x" for label, ci in spread if ci))
        by_round = [(row["label"], row["speedup_by_round"]) for row in s["rows"]
                    if row.get("speedup_by_round") and row.get("peer") is None]
        if by_round:
            console.print("speedup in each round (the machine's spells between rounds): " + "; ".join(
                f"{escape(label)} " + " / ".join(_fmt(x, ".2f") for x in rounds) for label, rounds in by_round))
        for row in s["rows"]:
            if row.get("mismatches"):
                where = ", ".join(f"{m['prompt_id']} at token {m['first_difference_at']}" for m in row["mismatches"][:4])
                console.print(f"[red]MISMATCH[/] {escape(row['label'])}: {len(row['mismatches'])}/{row.get('runs', row['prompts'])} runs "
                              f"differ from {escape(row['peer'])} target-only ({escape(where)})")
        copied = [row for row in s["rows"] if row.get("copied_share")]
        if copied:
            console.print("copied by prompt lookup where the head was unsure (share of drafted tokens, their acceptance): "
                          + ", ".join(f"{escape(row['label'])} {100 * row['copied_share']:.0f}% "
                                      f"{_fmt(row['copied_acceptance'], '.2f')}" for row in copied))
        ceiling = (s.get("copy_ceiling") or {}).get("tokens_per_call_median")
        if ceiling is not None:
            console.print(f"copy ceiling: the best possible prompt-lookup drafter emits {ceiling:.2f} tokens per target "
                          f"call (median over prompts): its speedup bound with free verification")
    limit = results["physical_limit"]
    costs = results["step_costs_ms"]
    low, high = limit.get("bandwidth_gb_s_range") or (limit["bandwidth_gb_s"],) * 2
    console.print(
        f"physical limit: {limit['target_weight_bytes'] / 1e6:.0f} MB of target weights per token / "
        f"{limit['bandwidth_gb_s']:.1f} GB/s (fp32 matrix-vector, median of {len(limit.get('rounds') or [1])} readings, "
        f"{low:.1f}-{high:.1f}) = {limit['target_floor_ms_per_token']:.1f} ms/token floor; "
        f"measured target-only {_fmt(limit['target_measured_ms_per_token'], '.1f')} ms/token "
        f"({_fmt(limit['target_measured_vs_floor'], '.2f')}x the floor)"
    )
    if limit.get("target_step_vs_floor") is not None:
        s_low, s_high = limit["target_step_vs_floor_range"]
        console.print(f"target engine step, each timed beside a bandwidth reading: {limit['target_step_vs_floor']:.2f}x "
                      f"its round's floor (rounds {s_low:.2f}-{s_high:.2f})")
    line = f"engine steps (64-token cache): target decode {costs['target_decode']:.1f} ms, verify K=4 " \
           f"{costs['target_verify_k4']:.1f} ms ({costs['verify_k4_vs_decode']:.2f}x)"
    if "draft_decode" in costs:
        line += f", draft decode {costs['draft_decode']:.2f} ms ({costs['draft_vs_target']:.3f}x the target)"
    if "target_batch16_decode" in costs:
        line += f"; 16 requests' decode in one call {costs['target_batch16_decode']:.1f} ms"
    console.print(line)
    for note in results.get("peer_notes") or []:
        console.print(f"peer note: {escape(note)}")


ENGINE_STYLE = {None: ("o", "-"), "hf": ("v", ":"), "openvino": ("s", "--"), "ortgenai": ("^", "-."),
                "llamacpp": ("D", (0, (1, 3)))}  # (marker, line style) per engine; None is specpipe


def plot(results: dict, path: Path) -> Path:
    """Three panels per run: speedup vs K (tokens/s over specpipe's target-only) and acceptance vs K, a line per
    engine and prompt set, specpipe's adaptive row dashed; then tokens/s of each engine alone and at its best."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_accept, ax_engines) = plt.subplots(1, 3, figsize=(16, 4.6))
    bars: list[tuple[str, float, float]] = []
    for index, s in enumerate(results["sets"]):
        color = f"C{index}"
        for engine in dict.fromkeys(r.get("peer") for r in s["rows"]):
            marker, style = ENGINE_STYLE.get(engine, ("x", ":"))
            name = f"{s['name']}: {engine or 'specpipe'}"
            fixed = sorted((r for r in s["rows"] if r.get("peer") == engine and r["strategy"] != "target-only"
                            and r["k"] is not None), key=lambda r: r["k"])
            if fixed:
                ks = [r["k"] for r in fixed]
                ax_speed.plot(ks, [r["speedup"] for r in fixed], marker=marker, linestyle=style, color=color,
                              label=f"{name} fixed K")
                ax_accept.plot(ks, [r["acceptance_rate"] for r in fixed], marker=marker, linestyle=style, color=color,
                               label=f"{name} fixed K")
            mine = [r for r in s["rows"] if r.get("peer") == engine]
            alone = next((r for r in mine if r["strategy"] == "target-only"), None)
            spec = max((r for r in mine if r["strategy"] != "target-only"), key=lambda r: r["tokens_per_s"], default=None)
            bars.append((name, alone["tokens_per_s"] if alone else 0.0, spec["tokens_per_s"] if spec else 0.0))
        adaptive = _row(s, "adaptive")
        if adaptive and adaptive["speedup"] is not None:
            ax_speed.axhline(adaptive["speedup"], linestyle="--", color=color, label=f"{s['name']}: specpipe adaptive")
        if adaptive and adaptive["acceptance_rate"] is not None:
            ax_accept.axhline(adaptive["acceptance_rate"], linestyle="--", color=color,
                              label=f"{s['name']}: specpipe adaptive")
    ax_speed.axhline(1.0, color="grey", linewidth=0.8)
    ax_speed.set(xlabel="K (tokens drafted per step)", ylabel="tokens/s / specpipe target-only", title="Speedup")
    ax_accept.set(xlabel="K (tokens drafted per step)", ylabel="accepted / drafted", title="Acceptance rate", ylim=(0, 1))
    positions = range(len(bars))
    ax_engines.barh([p + 0.2 for p in positions], [b[1] for b in bars], height=0.4, label="target alone")
    ax_engines.barh([p - 0.2 for p in positions], [b[2] for b in bars], height=0.4, label="best speculative row")
    ax_engines.set_yticks(list(positions), [b[0] for b in bars], fontsize=7)
    ax_engines.invert_yaxis()
    ax_engines.set(xlabel="tokens/s (median over prompts)", title="Engines")
    for ax in (ax_speed, ax_accept, ax_engines):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "no speculative rows with a fixed K", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"specpipe bench {results['engine_dir']} ({results['settings']['max_new_tokens']} new tokens, greedy)")
    return save_figure(fig, path)


def save_figure(fig, path) -> Path:
    """Lay out, write `fig` as a PNG at `path` (folders made), and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _row(prompt_set: dict, label: str) -> Optional[dict]:
    return next((r for r in prompt_set["rows"] if r["label"] == label), None)
