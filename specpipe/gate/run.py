"""`run_gate`: open what is under test, run the five checks with a progress bar, write the report.

Modes:
- "in-process": target = engines/<name>; no server; robustness is skipped.
- "repo": target = a Triton model repository; the gate starts tritonserver on free loopback ports.
- "url": target = host:port of a running server; `engines` names the deployment it serves (the exact
  probabilities and logit margins are computed from it in-process).
- "endpoint": target = the /v1 URL of an OpenAI-compatible server (specpipe/gate/endpoint.py); `engines` is the
  reference build (optional), `reference_endpoint` the reference server (optional; one of the two is needed).
  What cannot be checked through the endpoint is listed in the report's `not_checked`.
A setup problem (missing folder, unreachable server) raises a SpecpipeError (exit 2) before any check;
a check that cannot finish is recorded as an error and fails the gate (exit 1).
"""

from __future__ import annotations

import time
import traceback
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Literal, Optional

from specpipe.config import THREADS
from specpipe.errors import GateError, SpecpipeError
from specpipe.gate.config import GateConfig
from specpipe.gate.report import CheckResult, GateReport, write_report
from specpipe.gate.subjects import InProcessSubject, Subject

GateMode = Literal["in-process", "repo", "url", "endpoint"]
CHECKS = ("greedy_equivalence", "distribution_equivalence", "quantization_accuracy", "latency_slo", "robustness")


def run_gate(
    target: str | Path,
    gate: GateConfig,
    mode: GateMode,
    report_dir: str | Path,
    *,
    engines: Optional[str | Path] = None,
    model_name: Optional[str] = None,
    endpoint: Optional["EndpointOptions"] = None,
    remeasure: bool = False,
    threads: int = THREADS,
    progress: bool = True,
) -> GateReport:
    """Run every enabled check on `target` and write junit.xml, report.json and report.html."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specpipe.contract.manifest import now_iso
    from specpipe.machine import describe_machine, library_versions

    started_iso, started = now_iso(), time.perf_counter()
    console = Console(stderr=True, quiet=not progress)
    with _open_subject(target, mode, gate, engines=engines, model_name=model_name, endpoint=endpoint, threads=threads,
                       console=console) as subject:
        bar = Progress(
            TextColumn("{task.description:<26}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, disable=not progress,
        )
        with bar:
            checks = [_run_check(name, subject, gate, bar, remeasure) for name in CHECKS]
        not_checked = [f"{name}: {why}" for name in CHECKS if (why := subject.unsupported(name))] + subject.limitations()
    report = GateReport(
        mode=mode, target=str(target), gate=gate.model_dump(mode="json"), checks=checks, started=started_iso,
        duration_s=time.perf_counter() - started, versions=library_versions(),
        machine=describe_machine(threads).as_dict(), not_checked=not_checked,
    )
    write_report(report, Path(report_dir))
    return report


def _run_check(name: str, subject: Subject, gate: GateConfig, bar, remeasure: bool) -> CheckResult:
    from specpipe.gate import distribution, greedy, latency, quantization, server

    section = {"greedy_equivalence": gate.greedy, "distribution_equivalence": gate.distribution,
               "quantization_accuracy": gate.quantization, "latency_slo": gate.latency, "robustness": gate.robustness}[name]
    task = bar.add_task(name, total=None)
    tick: Callable[[int], None] = lambda n: bar.advance(task, n)  # noqa: E731
    started = time.perf_counter()
    try:
        if not section.enabled:
            result = CheckResult(name, "skipped", "disabled in the gate file")
        elif subject.unsupported(name):
            result = CheckResult(name, "skipped", subject.unsupported(name))
        elif name == "greedy_equivalence":
            bar.update(task, total=len(gate.prompts))
            result = greedy.check_greedy(subject, gate, tick)
        elif name == "distribution_equivalence":
            in_server = subject.mode != "in-process"
            budget = gate.distribution.server_samples if in_server else None
            planned = subject.distribution_cases(gate, budget)
            if planned is None:
                planned = distribution.plan_cases(subject, gate, budget)
            bar.update(task, total=sum(case.samples for case in planned))
            result = distribution.check_distribution(subject, gate, planned, tick, server_budget=in_server)
        elif name == "quantization_accuracy":
            deployment = subject.reference
            result = quantization.check_quantization(deployment.manifest, deployment.folder, gate, remeasure=remeasure)
        elif name == "latency_slo":
            bar.update(task, total=2 * gate.latency.requests)
            result = latency.check_latency(subject, gate, tick)
        elif subject.mode == "endpoint":
            from specpipe.gate import endpoint as endpoint_gate

            bar.update(task, total=len(endpoint_gate.bad_requests(subject.client.model, subject.chat)) + 1)
            result = endpoint_gate.check_robustness(subject, gate, tick)
        else:
            is_server = isinstance(subject, server.ServerSubject)
            bar.update(task, total=len(server.bad_requests(subject.reference)) + 1 if is_server else 1)
            result = server.check_robustness(subject if is_server else None, gate, tick)
    except SpecpipeError as err:
        result = CheckResult(name, "error", f"{type(err).__name__}: {err}")
    except Exception as err:  # a bug or a crashed server: recorded, and the gate fails
        result = CheckResult(name, "error", f"{type(err).__name__}: {err}", failures=[traceback.format_exc(limit=4)])
    result.duration_s = time.perf_counter() - started
    done = max(bar.tasks[task].completed, 1)
    bar.update(task, total=done, completed=done, description=f"{name} [{result.status}]")
    return result


@dataclass(frozen=True)
class EndpointOptions:
    """`validate --endpoint`: the reference server and how to reach both (specpipe/gate/endpoint.py)."""

    reference_endpoint: Optional[str] = None
    reference_model: Optional[str] = None  # default: the endpoint's --model
    reference_extra: Optional[dict] = None  # JSON fields every reference request carries, e.g. {"num_draft_tokens": 0}
    extra: Optional[dict] = None  # JSON fields every request to the endpoint carries, e.g. llama.cpp's {"min_p": 0}
    api_key: Optional[str] = None
    timeout_s: float = 300.0


@contextmanager
def _open_subject(target, mode: GateMode, gate: GateConfig, *, engines, model_name, endpoint, threads, console) -> Iterator[Subject]:
    from specpipe.deployment import load_deployment

    if mode == "endpoint":
        from specpipe.gate.endpoint import EndpointClient, EndpointSubject

        if not model_name:
            raise GateError("--endpoint: also pass --model, the model name the endpoint serves (see its /v1/models)")
        options = endpoint or EndpointOptions()
        reference = load_deployment(_existing(engines, "--reference folder"), threads=threads) if engines else None
        client = EndpointClient(str(target), model_name, chat=gate.chat, extra=options.extra, api_key=options.api_key,
                                timeout_s=options.timeout_s)
        reference_client = None
        if options.reference_endpoint:
            reference_client = EndpointClient(options.reference_endpoint, options.reference_model or model_name, chat=gate.chat,
                                              extra=options.reference_extra, api_key=options.api_key, timeout_s=options.timeout_s)
        with console.status(f"probing {target}"):
            subject = EndpointSubject(client, reference, reference_client, gate=gate)
        yield subject
        return

    if mode == "in-process":
        if engines is not None:
            raise GateError("--engines goes with --url; in-process, the target is the engines folder itself")
        yield InProcessSubject(load_deployment(_existing(target, "engines folder"), threads=threads), chat=gate.chat)
        return

    from specpipe.gate.server import ServerSubject, check_reachable
    from specpipe.triton.client import DEFAULT_MODEL
    from specpipe.triton.repository import served_engine_dir

    model_name = model_name or DEFAULT_MODEL
    if mode == "url":
        if engines is None:
            raise GateError(
                f"--url {target}: also pass --engines engines/NAME, the deployment this server serves"
                " (the distribution check needs the target's exact probabilities from it)"
            )
        reference = load_deployment(_existing(engines, "--engines folder"), threads=threads)
        check_reachable(str(target), model_name)
        yield ServerSubject(str(target), reference, model_name=model_name, chat=gate.chat)
        return

    if mode != "repo":
        raise GateError(f"unknown gate mode {mode!r}")
    from specpipe.triton.server import ServerConfig, TritonServer

    repo = _existing(target, "Triton model repository")
    reference = load_deployment(served_engine_dir(repo, model_name), threads=threads)
    server_cfg = ServerConfig.on_free_ports()
    with ExitStack() as stack:
        with console.status(f"starting tritonserver on {repo}"):
            server = stack.enter_context(TritonServer(repo, server_cfg))
        if server.leftovers:
            console.log(server.leftovers_note())
        console.log(f"tritonserver ready at {server.url} in {server.ready_s:.1f} s")
        yield ServerSubject(server.url, reference, model_name=model_name, chat=gate.chat)


def _existing(path, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise GateError(f"no such {what}: {path}")
    return path
