"""`specpipe serve REPO`: run a real Triton Inference Server on a model repository until Ctrl-C / SIGTERM."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Optional

import click

from specpipe.config import field_default, field_help, make_config
from specpipe.errors import ServerError
from specpipe.triton.server import ServerConfig, TritonServer


def _option(name: str, flag: str, type_, **kwargs):
    return click.option(flag, name, type=type_, default=field_default(ServerConfig, name), show_default=True,
                        help=kwargs.pop("help", field_help(ServerConfig, name)), **kwargs)


def _ended(server: TritonServer, code: int) -> str:
    if code == -signal.SIGKILL:  # from outside (kill -9, the OOM killer): its log cannot say why
        return "was killed by SIGKILL"
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"{how}: {server.failure_reason()}"


@click.command()
@click.argument("repo", type=click.Path(path_type=Path))
@_option("grpc_port", "--grpc-port", int, help="gRPC port (what `specpipe generate --url` talks to).")
@_option("http_port", "--http-port", int, help="HTTP port (health: /v2/health/ready).")
@_option("metrics_port", "--metrics-port", int, help="Prometheus metrics port (/metrics).")
@_option("host", "--host", str)
@_option("ready_timeout_s", "--timeout", float)
@click.option("--log-file", type=click.Path(path_type=Path), default=None,
              help="Write the server's log here [default: a temp file, printed at start].")
@click.option("--openai-port", type=click.IntRange(0, 65535), default=None,
              help="Also serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models; streaming) on this "
                   "port, in front of the same server; 0 = any free port. [default: off]")
def serve(repo: Path, grpc_port, http_port, metrics_port, host, ready_timeout_s, log_file: Optional[Path],
          openai_port: Optional[int]) -> None:
    """Serve the Triton model repository REPO (written by `specpipe build`) with tritonserver.

    \b
      specpipe serve triton_repo                     # gRPC 8001 (TensorRT-LLM's tensors), HTTP 8000
      specpipe serve triton_repo --openai-port 9000  # and http://127.0.0.1:9000/v1 for OpenAI clients
    """
    from specpipe.triton.openai_api import OpenAIConfig

    cfg = make_config(ServerConfig, host=host, grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port,
                      ready_timeout_s=ready_timeout_s)
    api_cfg = make_config(OpenAIConfig, host=host, port=openai_port) if openai_port is not None else None
    server = TritonServer(repo, cfg, log_path=log_file)
    api = None

    def _terminate(signum, frame):
        raise KeyboardInterrupt  # SIGTERM takes the same orderly path as Ctrl-C

    # SIGINT explicitly too: a shell starts background jobs with SIGINT ignored, and Python keeps that.
    previous = {signum: signal.signal(signum, _terminate) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        click.echo(f"starting tritonserver {server.install.source}; log: {server.log_path}", err=True)
        if server.leftovers:
            click.echo(server.leftovers_note(), err=True)
        ready_s = server.wait_ready()
        models = sorted(p.name for p in server.repo.iterdir() if p.is_dir() and not p.name.startswith("."))
        if api_cfg is not None:
            from specpipe.triton.openai_api import OpenAIServer, front_for_repository

            api = OpenAIServer(front_for_repository(repo, server.url, api_cfg.request_timeout_s), api_cfg).start()
        openai = f", OpenAI API {api.url}" if api is not None else ""
        click.echo(f"ready in {ready_s:.1f} s: models {', '.join(models)}; gRPC {server.url}, HTTP {server.http_url}, "
                   f"metrics {server.metrics_url}{openai}. Ctrl-C stops.", err=True)
        code = server.process.wait()
        server.stop()  # ends the stubs it left and removes their shared memory
        after = f"; after it: {server.cleanup.describe()}" if server.cleanup else ""
        raise ServerError(f"tritonserver {_ended(server, code)}{after}")
    except KeyboardInterrupt:
        click.echo("stopping tritonserver ...", err=True)
        code = server.stop()
        click.echo(f"stopped (exit code {code})", err=True)
    finally:
        if api is not None:
            api.stop()
        server.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
