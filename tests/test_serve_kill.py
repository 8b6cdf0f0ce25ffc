"""Nothing of a server survives the specpipe that started it, and a server never takes another's readiness.

A real `specpipe serve` is killed with SIGKILL (a stream in flight): tritonserver, its stub and its shared memory
must go with it. An orphaned server (one whose specpipe died before the kernel could end it, as before this
was fixed) holding the same ports is ended by the next start, which says so and then serves itself; any other
process on a port is named, and nothing starts. Every wait polls for a condition with a generous deadline:
the assertions are about what happens, never about how fast.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import specpipe
from specpipe.contract.generation import GenerationConfig
from specpipe.errors import ServerError
from specpipe.triton import ServerConfig, TritonServer, write_repository
from specpipe.triton.client import remote_generate
from specpipe.triton.ports import listeners
from specpipe.triton.stubs import SHM_DIR, find_servers, find_stubs, read_server, repository_prefix

PROJECT_ROOT = Path(specpipe.__file__).resolve().parents[1]
DEADLINE_S = 180  # for a condition on a loaded 2-core machine; reaching it fails the test
IN_FLIGHT = GenerationConfig(max_new_tokens=400, stop_on_eos=False)
pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir() or not Path("/proc/net/tcp").is_file(), reason="needs Linux")


@pytest.fixture
def repo(tiny_build, tmp_path) -> Path:
    write_repository(tiny_build, tmp_path / "repo")
    return tmp_path / "repo"


def _ports() -> ServerConfig:
    return ServerConfig.on_free_ports(ready_timeout_s=DEADLINE_S)


def _serve(repo: Path, cfg: ServerConfig) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specpipe", "serve", str(repo), "--grpc-port", str(cfg.grpc_port),
           "--http-port", str(cfg.http_port), "--metrics-port", str(cfg.metrics_port), "--timeout", str(DEADLINE_S)]
    return subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.05)


def _until_ready(process: subprocess.Popen) -> list[str]:
    """`specpipe serve`'s stderr lines (still filling) once its ready line is there."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(process.stderr.readline, "")), daemon=True).start()
    _wait_for(lambda: any("ready in" in line for line in lines) or process.poll() is not None, "ready line")
    assert any("ready in" in line for line in lines), "".join(lines)
    return lines


def _left_of(repo: Path) -> dict[str, list]:
    """What runs or lies in /dev/shm for this repository: its servers, stubs and shared-memory regions."""
    return {"servers": [s.pid for s in find_servers() if s.repo == repo.resolve()],
            "stubs": [s.pid for s in find_stubs() if s.model_py.resolve().is_relative_to(repo.resolve())],
            "regions": [p.name for p in SHM_DIR.glob(repository_prefix(repo) + "*")]}


def _end_all(repo: Path) -> None:
    """Test cleanup only, whatever a failed assertion left: by pid, nothing else."""
    for pid in _left_of(repo)["servers"] + _left_of(repo)["stubs"]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _answering_id(http_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2", timeout=10) as response:
        return json.loads(response.read())["name"]


def _refused(http_port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=10)
    except OSError:
        return True
    return False


@pytest.mark.timing
def test_serve_killed_with_sigkill_takes_its_server_stubs_and_shared_memory_with_it(repo):
    cfg = _ports()
    process = _serve(repo, cfg)
    try:
        lines = _until_ready(process)
        left = _left_of(repo)
        [server_pid], [stub_pid] = left["servers"], left["stubs"]
        assert read_server(server_pid).starter_pid == process.pid and left["regions"]
        # a long stream in flight, as when the user killed it
        outcome: dict = {}
        first = threading.Event()

        def stream() -> None:
            try:
                for _ in remote_generate(f"127.0.0.1:{cfg.grpc_port}", "def add(a, b):", IN_FLIGHT, stream=True,
                                         timeout_s=DEADLINE_S):
                    first.set()
                outcome["completed"] = True
            except ServerError as err:
                outcome["error"] = str(err)
            first.set()

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        assert first.wait(DEADLINE_S)

        process.kill()
        assert process.wait(timeout=DEADLINE_S) == -signal.SIGKILL

        _wait_for(lambda: _left_of(repo) == {"servers": [], "stubs": [], "regions": []},
                  f"nothing left of the server; left: {_left_of(repo)}")
        assert read_server(server_pid) is None and stub_pid not in [s.pid for s in find_stubs()]
        assert _refused(cfg.http_port) and not any(listeners(port) for port in (cfg.grpc_port, cfg.http_port,
                                                                                cfg.metrics_port))
        client.join(DEADLINE_S)
        assert not client.is_alive()  # the stream ended (an error, unless it was done already): no client hangs
        assert "Traceback" not in "".join(lines)
    finally:
        process.kill()
        _end_all(repo)


# Leaves a tritonserver on the given ports whose starter is gone, as a specpipe killed before its server could
# follow it did (the issue: it then answered the next start's readiness check). Prints its pid and --id.
_ORPHAN = """
import os, subprocess, sys, time
from pathlib import Path
from specpipe.triton.server import ServerConfig, TritonServer, find_tritonserver
repo, grpc, http, metrics = Path(sys.argv[1]), *map(int, sys.argv[2:5])
server = TritonServer(repo, ServerConfig(grpc_port=grpc, http_port=http, metrics_port=metrics))
server.install = find_tritonserver()
server.process = subprocess.Popen(server.command(), env={**os.environ, **server.install.env}, cwd=repo,
                                  start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
server._started = time.perf_counter()
server.wait_ready(float(sys.argv[5]))
print(server.process.pid, server.server_id, flush=True)
os._exit(0)
"""


def _leave_an_orphan(repo: Path, cfg: ServerConfig) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-c", _ORPHAN, str(repo), str(cfg.grpc_port), str(cfg.http_port),
                           str(cfg.metrics_port), str(DEADLINE_S)], capture_output=True, text=True, cwd=PROJECT_ROOT,
                          env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}, timeout=DEADLINE_S * 2)
    assert done.returncode == 0, done.stderr
    pid, server_id = done.stdout.split()
    return int(pid), server_id


@pytest.mark.timing
def test_the_next_serve_ends_an_orphan_on_its_ports_says_so_and_trusts_only_its_own_server(repo):
    cfg = _ports()
    orphan_pid, orphan_id = _leave_an_orphan(repo, cfg)
    process = None
    try:
        _wait_for(lambda: read_server(orphan_pid) is None or read_server(orphan_pid).orphaned, "the orphan re-parented")
        assert read_server(orphan_pid).orphaned and _answering_id(cfg.http_port) == orphan_id

        process = _serve(repo, cfg)
        lines = _until_ready(process)
        notes = [line for line in lines if "orphaned tritonserver" in line]
        assert len(notes) == 1, "".join(lines)
        assert f"ended 1 orphaned tritonserver (pid {orphan_pid} serving {repo.resolve()}" in notes[0]
        assert f"--grpc-port {cfg.grpc_port}, --http-port {cfg.http_port}, --metrics-port {cfg.metrics_port}" in notes[0]
        assert read_server(orphan_pid) is None

        new_id = _answering_id(cfg.http_port)
        assert new_id != orphan_id and new_id.startswith(f"specpipe-{process.pid}-")
        [server] = [s for s in find_servers() if s.repo == repo.resolve()]
        assert server.server_id == new_id and not server.orphaned
        generation = remote_generate(f"127.0.0.1:{cfg.grpc_port}", "def", GenerationConfig(max_new_tokens=4), stream=True)
        assert "".join(generation) == generation.result["text"] and generation.result["num_generated"] == 4

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=DEADLINE_S) == 0, "".join(lines)
        _wait_for(lambda: _left_of(repo) == {"servers": [], "stubs": [], "regions": []}, f"left: {_left_of(repo)}")
    finally:
        if process is not None:
            process.kill()
        if read_server(orphan_pid) is not None:
            os.killpg(orphan_pid, signal.SIGKILL)
        _end_all(repo)


def test_a_port_held_by_another_process_is_named_and_nothing_starts(repo):
    cfg = _ports()
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", cfg.http_port))
        held.listen()
        [holder] = listeners(cfg.http_port)
        assert holder.pid == os.getpid()
        process = _serve(repo, cfg)
        try:
            _, stderr = process.communicate(timeout=DEADLINE_S)
        finally:
            process.kill()
            _end_all(repo)
    lines = stderr.strip().splitlines()
    assert process.returncode == 2 and len(lines) == 1, stderr
    assert lines[0].startswith(f"error: --http-port {cfg.http_port} is in use by pid {os.getpid()} (")
    assert lines[0].endswith("stop it or choose another --http-port")
    assert _left_of(repo)["servers"] == []


class _OtherServer(http.server.BaseHTTPRequestHandler):
    """Answers as a ready Triton would, under another id."""

    def do_GET(self):  # noqa: N802
        body = json.dumps({"name": "someone-else", "version": "2.51.0"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_readiness_is_never_taken_from_another_server(repo):
    """However the port check was passed (a server that came up in between), the answer must carry our --id."""
    other = http.server.HTTPServer(("127.0.0.1", 0), _OtherServer)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        server = TritonServer(repo, ServerConfig(http_port=other.server_address[1], ready_timeout_s=DEADLINE_S))
        server.process = subprocess.Popen(["sleep", str(DEADLINE_S)])  # stands in for our own server, alive
        server._started = time.perf_counter()
        refusal = r"another server answers on .* \(id 'someone-else', not this start's specpipe-"
        with pytest.raises(ServerError, match=refusal) as caught:
            server.wait_ready()
        assert f"pid {os.getpid()}" in str(caught.value) and "\n" not in str(caught.value)
        assert server.process.poll() is not None  # ours was stopped, not left waiting
    finally:
        other.shutdown()
        server.process.kill()


def test_listeners_name_the_process_on_a_port_and_nothing_on_a_free_one():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        [holder] = listeners(port)
        assert (holder.pid, holder.port, holder.address) == (os.getpid(), port, "127.0.0.1")
        assert "\n" not in holder.describe() and holder.describe().startswith(f"pid {os.getpid()} (")
        assert listeners(port, "0.0.0.0") == [holder]  # a wildcard bind would collide with it too
    assert listeners(port) == []


# A process whose main thread has ended while another thread, and the listening socket the threads share, live on:
# how a killed tritonserver looks for a moment (its main thread a zombie, its other threads still exiting).
_HALF_EXITED = """
import ctypes, socket, threading, time
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
print(listener.getsockname()[1], flush=True)
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
ctypes.CDLL(None).pthread_exit(None)
"""


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_process_whose_main_thread_is_a_zombie_has_not_exited():
    """end_orphaned_servers waits for `exited`, not for the main thread to read as a zombie: a thread still running
    holds the process's sockets, and the next start would find its port held by a process it cannot see."""
    from specpipe.triton.stubs import exited

    child = subprocess.Popen([sys.executable, "-c", _HALF_EXITED], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        _wait_for(lambda: _state(child.pid) == "Z", "the main thread ended")
        assert listeners(port) and not exited(child.pid)  # the other thread holds the socket still
        child.kill()
        _wait_for(lambda: exited(child.pid), "the process exited")
        assert not listeners(port)
    finally:
        child.kill()
        child.wait()
    assert exited(child.pid)  # reaped: gone


# Starts a stand-in server (`sleep`) and its janitor as TritonServer.start does, prints both pids, and waits to be
# killed. argv: the region prefix, then how long the janitor waits for the server after EOF.
_STARTER = """
import subprocess, sys, time
from specpipe.triton.server import Janitor
Janitor.SERVER_EXIT_S = float(sys.argv[2])
server = subprocess.Popen(["sleep", "600"], start_new_session=True)
janitor = Janitor.start(server.pid, sys.argv[1])
print(server.pid, janitor.process.pid, flush=True)
time.sleep(600)
"""


def _killed_starter(prefix: str, server_exit_s: float) -> tuple[int, int]:
    """A starter killed with SIGKILL after starting a stand-in server and its janitor: (server pid, janitor pid)."""
    starter = subprocess.Popen([sys.executable, "-c", _STARTER, prefix, str(server_exit_s)], stdout=subprocess.PIPE,
                               text=True, cwd=PROJECT_ROOT, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    try:
        server_pid, janitor_pid = map(int, starter.stdout.readline().split())
    finally:
        starter.kill()
        starter.wait()
    return server_pid, janitor_pid


@pytest.mark.timing
def test_a_killed_starters_janitor_removes_the_regions_once_its_server_has_exited(tmp_path):
    """The stubs' watchdog can lose its race with the stub's own exit (the region stays): whoever started the server
    leaves a janitor that removes the server's regions after the server, whatever killed the starter. While the
    server runs, the janitor leaves its regions alone, even after giving up on it."""
    from specpipe.triton.stubs import exited, shm_prefix

    prefix = shm_prefix(tmp_path, "0123abcd")
    region = SHM_DIR / f"{prefix}stub-region"
    region.write_bytes(b"\0" * 4096)
    server_pid, janitor_pid = _killed_starter(prefix, server_exit_s=0.2)
    try:
        _wait_for(lambda: exited(janitor_pid), "the janitor gave up on a live server")
        assert region.exists() and not exited(server_pid)
    finally:
        os.kill(server_pid, signal.SIGKILL)

    server_pid, janitor_pid = _killed_starter(prefix, server_exit_s=DEADLINE_S)
    try:
        assert region.exists()
        os.kill(server_pid, signal.SIGKILL)
        _wait_for(lambda: not region.exists(), "the region removed after the server exited")
        _wait_for(lambda: exited(janitor_pid), "the janitor's exit")
    finally:
        region.unlink(missing_ok=True)
        if not exited(server_pid):
            os.kill(server_pid, signal.SIGKILL)
