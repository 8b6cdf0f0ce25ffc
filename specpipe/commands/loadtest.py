"""`specpipe loadtest`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import click

from specpipe.bench.config import LoadConfig
from specpipe.config import field_default, field_help, make_config
from specpipe.errors import UsageError


def parse_levels(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        levels = []
    if not levels:
        raise UsageError(f"--concurrency {text!r}: expected a list of user counts like 1,2,4,8,16")
    return levels


def _option(flag: str, name: str, **kwargs):
    default = field_default(LoadConfig, name)
    return click.option(flag, name, default=default, show_default=default is not None,
                        help=kwargs.pop("help", field_help(LoadConfig, name)), **kwargs)


@click.command()
@click.argument("target", required=False, type=click.Path(path_type=Path))
@click.option("--url", default=None, help="gRPC address of a running Triton server instead of TARGET.")
@click.option("--model", "model_name", default=None, help="Served model name. [default: ensemble]")
@click.option("-c", "--concurrency", default=",".join(map(str, field_default(LoadConfig, "concurrency"))),
              show_default=True, help="Levels: concurrent users, a list like 1,2,4.")
@_option("--requests", "requests", type=int)
@_option("--requests-per-user", "requests_per_user", type=int)
@_option("--warmup-requests", "warmup_requests", type=int)
@_option("--max-tokens", "max_tokens", type=int)
@_option("--prompts-set", "prompt_set", type=click.Choice(["code", "chat", "grounded"]))
@_option("--prompts", "prompts", type=click.Path(path_type=Path))
@_option("--draft-tokens", "num_draft_tokens", type=int)
@_option("--ignore-eos/--stop-at-eos", "ignore_eos")
@_option("--timeout", "request_timeout_s", type=float)
@_option("--label", "label", type=str)
@_option("--arrivals", "arrivals", type=click.Choice(["staggered", "burst"]))
@_option("--against-target-only/--as-deployed-only", "against_target_only")
@_option("--engine-alone/--no-engine-alone", "engine_alone")
@_option("--perf-metrics/--no-perf-metrics", "perf_metrics")
@_option("--stream-interval", "stream_interval", type=int)
@click.option("--compare", "compare", multiple=True, type=click.Path(path_type=Path),
              help="A loadtest JSON file whose runs join the table and plot (repeatable); alone, nothing is run.")
@click.option("--json-out", type=click.Path(path_type=Path), default=None, help="Write the report (every run) as JSON.")
@click.option("--plot", type=click.Path(path_type=Path), default=None,
              help="Write a PNG of tokens/s and TTFT p95 vs concurrency, one line per run.")
def loadtest(target: Optional[Path], url, model_name, concurrency, requests, requests_per_user, warmup_requests, max_tokens, prompt_set,
             prompts, num_draft_tokens, ignore_eos, request_timeout_s, label, arrivals, against_target_only, engine_alone,
             perf_metrics, stream_interval, compare, json_out, plot) -> None:
    """Drive a real Triton server with closed-loop streaming users at each concurrency: aggregate and per-request
    tokens/s, TTFT and inter-token latency p50/p95, errors, server memory.

    \b
      specpipe loadtest triton_repo --label one-at-a-time --json-out reports/load.json   # starts the server
      specpipe loadtest engines/NAME --draft-tokens 0 --label target-only                # a repository for it
      specpipe loadtest --url 127.0.0.1:8001 --compare reports/load.json --plot reports/load.png
      specpipe loadtest --compare a.json --compare b.json --plot both.png                # no new run
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specpipe.bench.load import make_report, read_reports, run_labels, run_loadtest
    from specpipe.bench.load_report import plot as write_plot
    from specpipe.bench.load_report import print_table

    if target is not None and url is not None:
        raise UsageError("give TARGET or --url, not both")
    if target is None and url is None and not compare:
        raise UsageError("give TARGET (a Triton repository or engines/NAME), --url, or --compare FILE")
    cfg = make_config(LoadConfig, concurrency=parse_levels(concurrency), requests=requests,
                      requests_per_user=requests_per_user,
                      warmup_requests=warmup_requests, max_tokens=max_tokens, prompt_set=prompt_set, prompts=prompts,
                      num_draft_tokens=num_draft_tokens, ignore_eos=ignore_eos,
                      request_timeout_s=request_timeout_s, label=label, arrivals=arrivals,
                      against_target_only=against_target_only, engine_alone=engine_alone,
                      perf_metrics=perf_metrics, stream_interval=stream_interval)
    runs = read_reports(list(compare))
    running = target is not None or url is not None
    make_report(runs + [{"label": label} for label in run_labels(cfg, target or url)] if running else runs)  # a clash fails before the run
    console = Console(stderr=True)
    if running:
        with Progress(TextColumn("[bold]loadtest"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.description}"), console=console, transient=True) as bar:
            task = bar.add_task("starting", total=None)
            runs += run_loadtest(cfg, target=target, url=url, model_name=model_name, log=bar.console.log,
                                 progress=lambda what, done, total: bar.update(task, description=what,
                                                                               completed=done, total=total))
    report = make_report(runs)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=1) + "\n")
    if plot:
        write_plot(report, plot)
    print_table(report, Console())
    for path in filter(None, (json_out, plot)):
        click.echo(f"wrote {path}")
