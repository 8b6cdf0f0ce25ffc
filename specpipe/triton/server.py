"""Run a real Triton Inference Server on a model repository: find it, start it, wait for it, stop it.

`tritonserver` comes from PATH (NVIDIA's container) or from the nvidia-pytriton wheel. The wheel needs
two set-up steps: its `nvidia_pytriton.libs` on LD_LIBRARY_PATH, and the Python-backend stub for this
interpreter's version copied next to the backend (done once, into specpipe's cache, not into
site-packages). The stub embeds libpython; putting *this* interpreter's LIBDIR first on
LD_LIBRARY_PATH makes it load the same Python, so model.py sees the same site-packages (torch,
onnxruntime, specpipe) as the process that started the server.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pydantic import Field, model_validator

from specpipe.config import Strict
from specpipe.errors import ServerError, UsageError
from specpipe.triton import stubs
from specpipe.triton.ports import listeners
from specpipe.triton.stubs import (TOKEN_HEX, Cleanup, clean_leftovers, clean_server, end_orphaned_servers, find_servers,
                                   server_id, shm_prefix)


class ServerConfig(Strict):
    """`specpipe serve`: where the server listens and how long to wait for it."""

    host: str = Field("127.0.0.1", description="address to bind (0.0.0.0 exposes the server)")
    grpc_port: int = Field(8001, ge=1, le=65535)
    http_port: int = Field(8000, ge=1, le=65535)
    metrics_port: int = Field(8002, ge=1, le=65535)
    ready_timeout_s: float = Field(300.0, gt=0, description="seconds to wait until every model is loaded")
    exit_timeout_s: int = Field(30, ge=0, description="seconds in-flight requests get to finish at shutdown")
    log_verbose: int = Field(0, ge=0, description="Triton's --log-verbose level")

    @model_validator(mode="after")
    def _ports_differ(self) -> "ServerConfig":
        # tritonserver refuses to start when two of its endpoints share a port; say so before starting it.
        named = {"--grpc-port": self.grpc_port, "--http-port": self.http_port, "--metrics-port": self.metrics_port}
        for i, (flag, port) in enumerate(named.items()):
            same = [other for other, p in list(named.items())[i + 1:] if p == port]
            if same:
                raise ValueError(f"{flag} and {same[0]} are both {port}: each endpoint needs a port of its own")
        return self

    @classmethod
    def on_free_ports(cls, **values) -> "ServerConfig":
        """A config whose three ports are distinct and free right now (tests, the demo, the gate, benchmarks)."""
        grpc_port, http_port, metrics_port = free_ports(3, values.get("host", "127.0.0.1"))
        return cls(grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port, **values)


@dataclass
class TritonInstall:
    """A runnable tritonserver: the binary, its backend folder (None = built-in default), extra env."""

    binary: Path
    backend_dir: Optional[Path] = None
    env: dict[str, str] = field(default_factory=dict)
    source: str = "from PATH"


def find_tritonserver() -> TritonInstall:
    """tritonserver on PATH first (NVIDIA's container), else the one in the nvidia-pytriton wheel."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path), env=_python_env())
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("tritonserver not found: not on PATH and nvidia-pytriton is not installed (pip install nvidia-pytriton)")
    dist = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    binary, libs = dist / "bin" / "tritonserver", dist.parent.parent / "nvidia_pytriton.libs"
    if not binary.is_file():
        raise ServerError(f"the nvidia-pytriton wheel has no tritonserver binary at {binary}")
    env = _python_env()
    env["LD_LIBRARY_PATH"] = _path_list(env.get("LD_LIBRARY_PATH"), str(libs))
    return TritonInstall(binary, _pytriton_backends(dist), env, source="from the nvidia-pytriton wheel")


def _pytriton_backends(dist: Path) -> Path:
    """backends/python/ with the wheel's backend library and the stub for this Python, in the cache."""
    from specpipe.checkpoint.cache import atomic_dir, cache_dir

    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"nvidia-pytriton has no Python-backend stub for Python {version} ({stub})")
    key = f"{os.stat(dist / 'bin' / 'tritonserver').st_mtime_ns:x}-py{version}"
    backends = cache_dir() / "triton-backends" / key
    if not (backends / "python" / "triton_python_backend_stub").is_file():
        with atomic_dir(backends) as tmp:
            shutil.copytree(dist / "backends" / "python", tmp / "python", ignore=shutil.ignore_patterns("__pycache__"))
            shutil.copy2(stub, tmp / "python" / "triton_python_backend_stub")
    return backends


def _python_env() -> dict[str, str]:
    """Environment that lets the Python-backend stub import what this interpreter imports."""
    env = {}
    libdir = sysconfig.get_config_var("LIBDIR")
    ldlibrary = sysconfig.get_config_var("LDLIBRARY") or ""
    if libdir and ldlibrary.endswith(".so") and (Path(libdir) / ldlibrary).exists():
        env["LD_LIBRARY_PATH"] = _path_list(libdir, os.environ.get("LD_LIBRARY_PATH"))
    # specpipe itself (even when not installed) and a virtualenv's site-packages, which the embedded
    # interpreter (it only knows its base prefix) would not find. The stub ignores PYTHONPATH (it runs
    # with ignore_environment), so model.py adds these entries to sys.path itself.
    extra = [str(Path(__file__).resolve().parents[2])]
    if sys.prefix != sys.base_prefix:
        import site

        extra += site.getsitepackages()
        # The embedded interpreter finds its prefix through `python3` on PATH: with the virtualenv's bin/ first
        # it starts as the virtualenv, so the stub's own early `import numpy` (before model.py runs) takes the
        # virtualenv's numpy, not the base Python's. A numpy 2 in the base Python (a stub built for numpy 1)
        # crashed the stub on the first string input: "unpack_from requires a buffer of at least 235802130 bytes".
        env["PATH"] = _path_list(str(Path(sys.prefix) / "bin"), os.environ.get("PATH"))
    env["PYTHONPATH"] = _path_list(*extra, os.environ.get("PYTHONPATH"))
    return env


def _path_list(*parts: Optional[str]) -> str:
    return os.pathsep.join(p for p in parts if p)


class TritonServer:
    """A tritonserver process serving `repo`. As a context manager: started and ready inside, stopped after.

        with TritonServer(repo, ServerConfig(grpc_port=p1, http_port=p2, metrics_port=p3)) as server:
            remote_generate(server.url, ...)

    Nothing of a server outlives it: once it has exited, however it ended, stop() ends the Python-backend
    stubs it left and removes their shared memory (`cleanup` says what there was); start() first removes
    what an earlier server of the same repository left (`leftovers`). The server dies with the thread that
    started it, even by SIGKILL (PR_SET_PDEATHSIG), and its stubs follow it (their watchdog). Readiness is
    only ever taken from this server: its ports must be free before it starts (an orphaned server of an
    earlier specpipe is ended, anything else is named in the error), and the server answering must carry
    this start's `--id`.
    """

    def __init__(self, repo: Path, config: Optional[ServerConfig] = None, *, log_path: Optional[Path] = None,
                 install: Optional[TritonInstall] = None):
        self.repo = Path(repo).resolve()
        self.config = config or ServerConfig()
        self.install = install
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path else None
        self.process: Optional[subprocess.Popen] = None
        self.ready_s: Optional[float] = None
        # Regions named for this server alone: what it leaves can be told from other servers' (ours or not).
        token = secrets.token_hex(TOKEN_HEX // 2)
        self.shm_prefix = shm_prefix(self.repo, token)
        self.server_id = server_id(token)  # what GET /v2 answers: the readiness check knows its own server
        self.leftovers = Cleanup()
        self.cleanup = Cleanup()
        self._cleaned = False
        self._janitor: Optional[Janitor] = None

    # -- addresses -------------------------------------------------------------------------------
    @property
    def _connect_host(self) -> str:
        return "127.0.0.1" if self.config.host in ("0.0.0.0", "", "::") else self.config.host

    @property
    def url(self) -> str:
        """gRPC address, as tritonclient.grpc and `specpipe generate --url` take it."""
        return f"{self._connect_host}:{self.config.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self._connect_host}:{self.config.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._connect_host}:{self.config.metrics_port}/metrics"

    # -- lifecycle --------------------------------------------------------------------------------
    def command(self) -> list[str]:
        cfg, install = self.config, self.install
        cmd = [
            str(install.binary),
            f"--id={self.server_id}",
            f"--model-repository={self.repo}",
            f"--grpc-address={cfg.host}", f"--grpc-port={cfg.grpc_port}",
            f"--http-address={cfg.host}", f"--http-port={cfg.http_port}",
            f"--metrics-address={cfg.host}", f"--metrics-port={cfg.metrics_port}",
            "--allow-gpu-metrics=false",
            f"--exit-timeout-secs={cfg.exit_timeout_s}",
            f"--log-verbose={cfg.log_verbose}",
            # Our configs are complete; skipping auto-complete saves one stub launch per model.
            "--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        if install.backend_dir is not None:
            cmd.append(f"--backend-directory={install.backend_dir}")
        return cmd

    def start(self) -> "TritonServer":
        """Start the server (not waiting for it). Call it from the thread that lives as long as the server should:
        the kernel ends the server when that thread exits, however it exits."""
        if not self.repo.is_dir():
            raise UsageError(f"no such model repository: {self.repo}")
        if not any(p.is_dir() and not p.name.startswith(".") for p in self.repo.iterdir()):
            raise UsageError(f"{self.repo} holds no models; write one with `specpipe build` (--repo-dir)")
        self.install = self.install or find_tritonserver()
        self.leftovers = self._claim_ports()
        self.leftovers += clean_leftovers(self.repo)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"specpipe-triton-{self.config.grpc_port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        env = {**os.environ, **self.install.env}
        with open(self.log_path, "wb") as log:
            # Own session: a Ctrl-C in the terminal reaches us, and we stop the server in order; its stubs share
            # its process group, so one killpg ends the whole tree.
            # cwd = the repository: the caller's folder must not leak onto the stub's sys.path ('' is on it).
            self.process = subprocess.Popen(dies_with_parent(self.command()), stdout=log, stderr=subprocess.STDOUT,
                                            env=env, cwd=self.repo, stdin=subprocess.DEVNULL, start_new_session=True)
        self._janitor = Janitor.start(self.process.pid, self.shm_prefix)
        self._started = time.perf_counter()
        return self

    def wait_ready(self, timeout: Optional[float] = None) -> float:
        """Block until every model is loaded; returns seconds since start. Failure: ServerError, server stopped."""
        timeout = self.config.ready_timeout_s if timeout is None else timeout
        deadline = self._started + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"tritonserver exited with code {code}: {self.failure_reason()}{self._tail_text()}")
            if self._is_ready():
                self.ready_s = time.perf_counter() - self._started
                return self.ready_s
            if time.perf_counter() > deadline:
                self.stop()
                raise ServerError(f"tritonserver was not ready after {timeout:.0f} s: {self.failure_reason()}{self._tail_text()}")
            time.sleep(0.1)

    def _is_ready(self) -> bool:
        """This server (its --id) answers and says every model is loaded. Another server answering on our port
        is a ServerError naming it, never a ready server."""
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2", timeout=2) as response:
                answering = json.loads(response.read()).get("name")
            if answering != self.server_id:
                holders = "; ".join(holder.describe() for holder in listeners(self.config.http_port, self.config.host))
                self.stop()
                raise ServerError(f"another server answers on {self.http_url} (id {answering!r}, not this start's "
                                  f"{self.server_id}): {holders or 'it could not be found'}")
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError, AttributeError):
            return False

    def _ports(self) -> dict[str, int]:
        return {"--grpc-port": self.config.grpc_port, "--http-port": self.config.http_port,
                "--metrics-port": self.config.metrics_port}

    def _claim_ports(self) -> Cleanup:
        """Before starting: end the orphaned servers (their specpipe is gone) that hold one of our ports or serve our
        repository; then any other process listening on one of our ports is a ServerError that names it."""
        held: dict[int, list[str]] = {}
        for option, port in self._ports().items():
            for holder in listeners(port, self.config.host):
                held.setdefault(holder.pid, []).append(f"{option} {port}")
        orphans = [server for server in find_servers() if server.orphaned and (server.pid in held or server.repo == self.repo)]
        why = {pid: "it held " + ", ".join(ports) for pid, ports in held.items()}
        ended = end_orphaned_servers(orphans, why) if orphans else Cleanup()
        for option, port in self._ports().items():
            holders = listeners(port, self.config.host)
            if holders:
                raise ServerError(f"{option} {port} is in use by {'; '.join(holder.describe() for holder in holders)}: "
                                  f"stop it or choose another {option}")
        return ended

    def stop(self, timeout: Optional[float] = None) -> Optional[int]:
        """SIGTERM (Triton drains in-flight requests for exit_timeout_s), then SIGKILL to its process group if it
        hangs; then, however the server ended, end the stubs it left and remove their shared memory."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=(self.config.exit_timeout_s + 15) if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)  # not yet reaped: the group id is still the server's
                self.process.wait()
        if not self._cleaned:
            self.cleanup, self._cleaned = clean_server(self.shm_prefix), True
        if self._janitor is not None:
            self._janitor.release()
        return self.process.returncode

    def leftovers_note(self) -> str:
        """One line on what earlier servers left and start() ended or removed ('' when nothing)."""
        if not self.leftovers:
            return ""
        return f"cleaned up after an earlier server: {self.leftovers.describe()}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._own_log and self.log_path is not None and exc[0] is None:
            self.log_path.unlink(missing_ok=True)

    # -- logs -------------------------------------------------------------------------------------
    def log_tail(self, lines: int = 15) -> list[str]:
        if self.log_path is None or not self.log_path.exists():
            return []
        with open(self.log_path, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=lines)]

    def _tail_text(self, lines: int = 8) -> str:
        """The last log lines worth reading: Triton's status tables and blank lines skipped, long lines cut."""
        tail = [line for line in self.log_tail(400)
                if line.strip() and line.lstrip()[:1] not in ("|", "+") and not line.endswith("] ")][-lines:]
        tail = [line if len(line) <= 300 else line[:297] + "..." for line in tail]
        return ("\nlast server log lines (" + str(self.log_path) + "):\n  " + "\n  ".join(tail)) if tail else ""

    def failure_reason(self) -> str:
        """One line saying why the server stopped or is not ready, read from its log."""
        lines = self.log_tail(400)
        return failure_reason(lines)


# Run in the child before it becomes tritonserver (os.execv keeps its pid): the kernel sends it SIGKILL when the
# thread that started it exits, however it exits (a `kill -9` of specpipe left tritonserver and its 970 MB stub
# serving on for good). SIGKILL, not SIGTERM: no one is left to wait for a drain, and the stubs' watchdog ends
# them and removes their regions as soon as the server is gone. A separate interpreter, not a preexec_fn: that
# runs between fork and exec, where a lock another thread held at the fork can deadlock the child.
_DIES_WITH_PARENT = ("import ctypes, os, signal, sys; PR_SET_PDEATHSIG = 1\n"
                     "ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))\n"
                     "if os.getppid() != int(sys.argv[1]): os._exit(1)  # the parent died before prctl took effect\n"
                     "os.execv(sys.argv[2], sys.argv[2:])")


def dies_with_parent(command: list[str]) -> list[str]:
    """`command`, run so that it dies with the calling thread (Linux; elsewhere as it is)."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-S", "-E", "-c", _DIES_WITH_PARENT, str(os.getpid()), *command]


# Run beside the server, in a session of its own and without PR_SET_PDEATHSIG, so it outlives us: it blocks on a pipe
# whose write end only we hold. At EOF (stop() is done, or we are gone, however we went) it waits until the server
# has exited and then does what stop() would have done: end the server's stubs, remove its regions. The stubs'
# watchdog (stubs.exit_with_server) removes a stub's own region too, but it races the stub's native health check,
# which exits the process without removing it once the server is reaped: under a CPU hog the native check won once
# in six SIGKILLs of `specpipe serve` (tests/test_serve_kill.py, AMD EPYC Zen 3, session 18). stubs.py is loaded by
# path: it needs only the standard library, so this interpreter starts with -S -E and imports nothing else.
_CLEANS_UP_AFTER = ("import importlib.util, sys, time\n"
                    "spec = importlib.util.spec_from_file_location('specpipe_stubs', sys.argv[1])\n"
                    "stubs = sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
                    "spec.loader.exec_module(stubs)\n"
                    "sys.stdin.buffer.read()\n"
                    "server_pid, prefix, deadline = int(sys.argv[2]), sys.argv[3], time.monotonic() + float(sys.argv[4])\n"
                    "while not stubs.exited(server_pid):\n"
                    "    if time.monotonic() > deadline: sys.exit(0)  # the server lives on: not ours to clean\n"
                    "    time.sleep(0.05)\n"
                    "stubs.clean_server(prefix)\n")


@dataclass
class Janitor:
    """The process that cleans up after a server once its starter lets go (`_CLEANS_UP_AFTER`); Linux only."""

    process: subprocess.Popen
    write_end: int
    SERVER_EXIT_S = 120.0  # how long it waits for a server to exit after EOF before leaving it be

    @classmethod
    def start(cls, server_pid: int, prefix: str) -> Optional["Janitor"]:
        if not sys.platform.startswith("linux"):
            return None
        read_end, write_end = os.pipe()  # not inheritable: no other child of ours holds the write end
        try:
            process = subprocess.Popen([sys.executable, "-S", "-E", "-c", _CLEANS_UP_AFTER, stubs.__file__,
                                        str(server_pid), prefix, str(cls.SERVER_EXIT_S)],
                                       stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       cwd="/", start_new_session=True)
        except OSError:
            os.close(write_end)
            return None  # stop() still cleans up; only a SIGKILL of this process would leave regions behind
        finally:
            os.close(read_end)
        return cls(process, write_end)

    def release(self, timeout_s: float = 10.0) -> None:
        """EOF to the janitor (the server has exited and stop() has cleaned up), then reap it."""
        if self.write_end >= 0:
            os.close(self.write_end)
            self.write_end = -1
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass  # it finishes on its own; init reaps it


# Triton's log lines that appear on every CPU-only start and explain nothing.
_HARMLESS = re.compile(r"CudaDriverHelper|pinned memory|NVML|DCGM|CUDA driver|cuda_memory_manager|GPU metrics")
_LOAD_FAILED = re.compile(r"failed to load '(?P<model>[^']+)' version (?P<version>\d+): (?P<why>.*)")


def failure_reason(lines: list[str]) -> str:
    for line in lines:
        match = _LOAD_FAILED.search(line)
        if match:
            # Triton escapes newlines in the quoted message; the first line is the reason.
            why = match["why"].split("\\n")[0].rstrip('"').strip()
            return f"model '{match['model']}' failed to load: {why}"
    for line in lines:
        if line.startswith("error:"):
            return line
    errors = [line for line in lines if line[:1] == "E" and re.match(r"E\d{4} ", line) and not _HARMLESS.search(line)]
    if errors:
        return errors[0].split("] ", 1)[-1].strip('"')
    return next((line for line in reversed(lines) if line.strip()), "no log output")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (for tests and `serve --grpc-port 0`-style use)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports nothing listens on right now.

    Every socket stays bound until all `n` are chosen: the kernel may hand a port just released straight out
    again, so calling free_port() three times can return one port twice (CI saw gRPC and metrics on one port).
    """
    import socket
    from contextlib import ExitStack

    with ExitStack() as held:
        ports = []
        for _ in range(n):
            s = held.enter_context(socket.socket())
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
        return ports
