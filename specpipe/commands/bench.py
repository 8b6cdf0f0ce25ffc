"""`specpipe bench`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specpipe.bench.config import BenchConfig
from specpipe.config import field_choices, field_default, field_help, make_config
from specpipe.errors import UsageError

_DEFAULT_K = field_default(BenchConfig, "draft_lengths")
_DRAFT_LENGTHS = f"{min(_DEFAULT_K)}..{max(_DEFAULT_K)}"  # BenchConfig's default, as -k writes it


def parse_draft_lengths(text: str, option: str = "-k") -> list[int]:
    """"1..8" -> [1..8]; "1,2,4" -> [1, 2, 4]."""
    try:
        if ".." in text:
            low, high = (int(part) for part in text.split("..", 1))
            return list(range(low, high + 1))
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"{option} {text!r}: expected a range like 1..8 or a list like 1,2,4") from None


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--prompts", "prompt_files", multiple=True, type=click.Path(path_type=Path),
              help="JSONL prompt file (repeatable).")
@click.option("--prompts-set", "prompt_sets", multiple=True, type=click.Choice(field_choices(BenchConfig, "prompt_sets")),
              help="Packaged prompt set (repeatable). Default: code and chat, unless --prompts is given.")
@click.option("-k", "--draft-lengths", default=_DRAFT_LENGTHS, show_default=True, help="Fixed K values: a range 1..8 or a list 1,2,4.")
@click.option("--no-adaptive", is_flag=True, help="Skip the adaptive-K row.")
@click.option("--draft", "head", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help=field_help(BenchConfig, "head") + ".")
@click.option("--peer", "peer_names", default=",".join(field_default(BenchConfig, "peers")), show_default=True,
              help="Peers to run beside specpipe: a list of hf, openvino, ortgenai, llamacpp, or all / none. "
                   "openvino and ortgenai need `pip install 'specpipe[peers]'`, llamacpp 'specpipe[peers-llamacpp]'; "
                   "a missing one is a note, not a failure.")
@click.option("--peer-k", "peer_draft_lengths", default=None,
              help="Fixed K values for the peers' draft-model rows, like -k. Default: the -k values.")
@click.option("--no-peer", is_flag=True, help="Skip every peer (same as --peer none).")
@click.option("--max-new-tokens", type=int, default=field_default(BenchConfig, "max_new_tokens"), show_default=True)
@click.option("--threads", type=int, default=field_default(BenchConfig, "threads"), show_default=True,
              help=field_help(BenchConfig, "threads"))
@click.option("--max-prompts", type=int, default=None, help=field_help(BenchConfig, "max_prompts"))
@click.option("--warmup-prompts", type=int, default=field_default(BenchConfig, "warmup_prompts"), show_default=True,
              help=field_help(BenchConfig, "warmup_prompts"))
@click.option("--rounds", type=int, default=field_default(BenchConfig, "rounds"), show_default=True,
              help=field_help(BenchConfig, "rounds"))
@click.option("--no-chat", is_flag=True, help="Send prompts as plain text, without the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as one JSON object.")
@click.option("--json-out", type=click.Path(path_type=Path), default=None, help="Also write the JSON results to this file.")
@click.option("--plot", type=click.Path(path_type=Path), default=None, help="Write a PNG: speedup and acceptance vs K, tokens/s per engine.")
def bench(engine_dir, prompt_files, prompt_sets, draft_lengths, no_adaptive, head, peer_names, peer_draft_lengths, no_peer,
          max_new_tokens, threads, max_prompts, warmup_prompts, rounds, no_chat, as_json, json_out, plot) -> None:
    """Benchmark ENGINE_DIR (engines/NAME): target-only, speculative K=1..8 and adaptive, and the peers (other
    engines on the same pair), on the same prompts in one run; tokens/s, TTFT, acceptance, speedup."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    from specpipe.bench import run_bench
    from specpipe.bench.peers import parse_peers
    from specpipe.bench.report import plot as write_plot
    from specpipe.bench.report import print_tables

    cfg = make_config(BenchConfig, engine_dir=engine_dir, prompts=list(prompt_files), prompt_sets=list(prompt_sets),
                      draft_lengths=parse_draft_lengths(draft_lengths), adaptive=not no_adaptive, head=head,
                      peers=[] if no_peer else parse_peers(peer_names),
                      peer_draft_lengths=parse_draft_lengths(peer_draft_lengths, "--peer-k") if peer_draft_lengths else None,
                      max_new_tokens=max_new_tokens, threads=threads, chat=not no_chat, max_prompts=max_prompts,
                      warmup_prompts=warmup_prompts, rounds=rounds)
    console = Console(stderr=True)
    with Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), TextColumn("{task.description}"), console=console, transient=True) as bar:
        task = bar.add_task("loading", total=None)
        results = run_bench(cfg, progress=lambda what, done, total: bar.update(task, description=what, completed=done,
                                                                               total=total))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(results, indent=1) + "\n")
    if plot:
        write_plot(results, plot)
    if as_json:
        click.echo(json.dumps(results))
    else:
        print_tables(results, Console())
        for path in filter(None, (json_out, plot)):
            click.echo(f"wrote {path}")
