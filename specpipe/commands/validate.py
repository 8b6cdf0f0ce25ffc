"""`specpipe validate`: the pre-release gate. Exit 0 = every check passed, 1 = a check failed, 2 = usage/setup."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import click

from specpipe.config import RuntimeConfig, field_default, field_help, make_config
from specpipe.errors import GateFailedError, UsageError

DEFAULT_REPORT_DIR = Path("reports/gate")


@click.command()
@click.argument("target", required=False, type=click.Path(path_type=Path))
@click.option("--gate", "gate_file", type=click.Path(path_type=Path), default=None,
              help="Gate file (TOML, see build/gate.toml). [default: the built-in default gate]")
@click.option("--in-process", is_flag=True, help="TARGET is engines/NAME: run the checks without a server.")
@click.option("--url", default=None, help="gRPC address of a running Triton server (e.g. 127.0.0.1:8001).")
@click.option("--engines", type=click.Path(path_type=Path), default=None,
              help="With --url: engines/NAME, the deployment that server serves.")
@click.option("--model", "model_name", default=None, help="Served model name. [default: ensemble]")
@click.option("--report-dir", type=click.Path(path_type=Path), default=DEFAULT_REPORT_DIR, show_default=True,
              help="Where junit.xml, report.json and report.html go.")
@click.option("--remeasure", is_flag=True, help="Measure quantization accuracy again instead of reading the manifest.")
@click.option("--threads", type=int, default=field_default(RuntimeConfig, "threads"), show_default=True,
              help=field_help(RuntimeConfig, "threads") + " for in-process engines.")
@click.option("--json", "as_json", is_flag=True, help="Print report.json instead of the summary.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def validate(target: Optional[Path], gate_file, in_process, url, engines, model_name, report_dir, remeasure, threads,
             as_json, quiet) -> None:
    """Validate a deployment: greedy and distribution equivalence, quantization accuracy, latency SLOs,
    robustness.

    \b
      specpipe validate triton_repo --gate build/gate.toml          # starts the server itself
      specpipe validate --url 127.0.0.1:8001 --engines engines/NAME  # a running server
      specpipe validate engines/NAME --in-process                    # no server
    """
    from specpipe.gate import load_gate, run_gate

    if url is not None and (target is not None or in_process):
        raise UsageError("give TARGET or --url, not both (--in-process takes TARGET = engines/NAME)")
    if url is None and target is None:
        raise UsageError("give TARGET (a Triton repository, or engines/NAME with --in-process) or --url")
    if url is None and not in_process and (target / "manifest.json").is_file():
        raise UsageError(f"{target} is an engines folder: add --in-process, or validate its Triton repository")
    runtime = make_config(RuntimeConfig, threads=threads)
    mode = "url" if url is not None else "in-process" if in_process else "repo"

    gate = load_gate(gate_file)
    report = run_gate(url or target, gate, mode, report_dir, engines=engines, model_name=model_name,
                      remeasure=remeasure, threads=runtime.threads, progress=not quiet)
    if as_json:
        click.echo((report.report_dir / "report.json").read_text(), nl=False)
    else:
        click.echo("\n".join(report.summary_lines()))
    if not report.passed:
        raise GateFailedError(report.failed_checks(), str(report.report_dir / "report.html"))
