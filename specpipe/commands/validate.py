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
@click.option("--endpoint", default=None,
              help="The /v1 URL of an OpenAI-compatible server (trtllm-serve, vLLM, SGLang, llama.cpp, specpipe serve "
                   "--openai-port), e.g. http://127.0.0.1:9000/v1. Needs --model and a reference.")
@click.option("--reference", type=click.Path(path_type=Path), default=None,
              help="With --endpoint: engines/NAME, the target run in this process (exact probabilities, near-ties).")
@click.option("--reference-endpoint", default=None,
              help="With --endpoint: the /v1 URL of the reference server (the same deployment with speculation off).")
@click.option("--reference-model", default=None, help="Model name at --reference-endpoint. [default: --model]")
@click.option("--reference-extra", default=None,
              help='JSON fields every reference request carries, e.g. \'{"num_draft_tokens": 0}\' (specpipe serve: '
                   "speculation off on the same endpoint).")
@click.option("--endpoint-extra", default=None,
              help='JSON fields every request to --endpoint carries (the server\'s own sampling defaults turned off), '
                   'e.g. llama.cpp\'s \'{"min_p": 0, "repeat_penalty": 1}\'. The reference endpoint gets them too '
                   "unless --reference-extra is given.")
@click.option("--api-key", default=None, help="Bearer token for the endpoints, if they want one.")
@click.option("--model", "model_name", default=None,
              help="Served model name. [default: ensemble; with --endpoint: required, see its /v1/models]")
@click.option("--report-dir", type=click.Path(path_type=Path), default=DEFAULT_REPORT_DIR, show_default=True,
              help="Where junit.xml, report.json and report.html go.")
@click.option("--remeasure", is_flag=True, help="Measure quantization accuracy again instead of reading the manifest.")
@click.option("--threads", type=int, default=field_default(RuntimeConfig, "threads"), show_default=True,
              help=field_help(RuntimeConfig, "threads") + " for in-process engines.")
@click.option("--json", "as_json", is_flag=True, help="Print report.json instead of the summary.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def validate(target: Optional[Path], gate_file, in_process, url, engines, endpoint, reference, reference_endpoint,
             reference_model, reference_extra, endpoint_extra, api_key, model_name, report_dir, remeasure, threads, as_json, quiet) -> None:
    """Validate a deployment: greedy and distribution equivalence, quantization accuracy, latency SLOs,
    robustness.

    \b
      specpipe validate triton_repo --gate build/gate.toml          # starts the server itself
      specpipe validate --url 127.0.0.1:8001 --engines engines/NAME  # a running server
      specpipe validate engines/NAME --in-process                    # no server
      specpipe validate --endpoint http://127.0.0.1:9000/v1 --model ensemble --reference engines/NAME
      specpipe validate --endpoint URL --model M --reference-endpoint URL_WITHOUT_SPECULATION

    \b
    Through an endpoint the report lists what could not be checked there (`not_checked`).
    """
    from specpipe.gate import load_gate, run_gate

    if endpoint is not None:
        mode, options = "endpoint", _endpoint_options(target, in_process, url, engines, reference, reference_endpoint,
                                                      reference_model, reference_extra, endpoint_extra, api_key, model_name)
        engines, target = reference, endpoint
    elif reference or reference_endpoint or reference_model or reference_extra or endpoint_extra:
        raise UsageError("--reference, --reference-endpoint, --reference-model, --reference-extra and --endpoint-extra go "
                         "with --endpoint")
    else:
        mode, options = None, None
    if mode is None and url is not None and (target is not None or in_process):
        raise UsageError("give TARGET or --url, not both (--in-process takes TARGET = engines/NAME)")
    if mode is None and url is None and target is None:
        raise UsageError("give TARGET (a Triton repository, or engines/NAME with --in-process), --url or --endpoint")
    if mode is None and url is None and not in_process and (target / "manifest.json").is_file():
        raise UsageError(f"{target} is an engines folder: add --in-process, or validate its Triton repository")
    runtime = make_config(RuntimeConfig, threads=threads)
    mode = mode or ("url" if url is not None else "in-process" if in_process else "repo")

    gate = load_gate(gate_file)
    report = run_gate(url or target, gate, mode, report_dir, engines=engines, model_name=model_name, endpoint=options,
                      remeasure=remeasure, threads=runtime.threads, progress=not quiet)
    if as_json:
        click.echo((report.report_dir / "report.json").read_text(), nl=False)
    else:
        click.echo("\n".join(report.summary_lines()))
    if not report.passed:
        raise GateFailedError(report.failed_checks(), str(report.report_dir / "report.html"))


def _endpoint_options(target, in_process, url, engines, reference, reference_endpoint, reference_model, reference_extra,
                      endpoint_extra, api_key, model_name):
    """--endpoint's options checked together: one UsageError line for a bad combination."""
    from specpipe.gate.run import EndpointOptions

    if target is not None or in_process or url is not None or engines is not None:
        raise UsageError("--endpoint goes without TARGET, --in-process, --url and --engines (the reference build is --reference)")
    if not model_name:
        raise UsageError("--endpoint: also pass --model, the name the endpoint serves (see its /v1/models)")
    if reference is None and reference_endpoint is None:
        raise UsageError("--endpoint needs a reference: --reference engines/NAME and/or --reference-endpoint URL")
    if reference_extra is not None and reference_endpoint is None:
        raise UsageError("--reference-extra goes with --reference-endpoint")
    extra = _json_object("--endpoint-extra", endpoint_extra)
    reference_fields = _json_object("--reference-extra", reference_extra) if reference_extra is not None else extra
    return EndpointOptions(reference_endpoint=reference_endpoint, reference_model=reference_model,
                           reference_extra=reference_fields, extra=extra, api_key=api_key)


def _json_object(option: str, text: Optional[str]) -> Optional[dict]:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{option} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{option} must be a JSON object")
    return value
