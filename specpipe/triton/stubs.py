"""What a tritonserver leaves behind: the Python-backend stub processes it starts (one per model instance),
their shared memory, and the server itself when the specpipe process that started it is gone.

A stub outlives a server that is killed: it keeps every engine it loaded in memory (1.1 GB for the SmolLM2
demo), ignores SIGTERM, and its region stays in /dev/shm. This module finds stubs by their command line,
ends them and removes their regions (`TritonServer` does so once its server has exited, and before it starts
a server, for what an earlier server of the same repository left), and gives model.py a watchdog that ends
the stub itself as soon as its server is gone. A server outlives the specpipe that started it only if the
kernel could not end it (see `TritonServer.start`); its `--id` names that specpipe, so the next start can
tell such an orphan from a server someone runs, and end it.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

SHM_DIR = Path("/dev/shm")
STUB_BINARY = "triton_python_backend_stub"
TOKEN_HEX = 8  # characters of the per-server token in a region prefix


@dataclass(frozen=True)
class Stub:
    """A running stub. The Python backend (2.51) starts it as
    `triton_python_backend_stub MODEL_PY SHM_REGION SHM_DEFAULT SHM_GROWTH SERVER_PID PYTHON_LIB ...`."""

    pid: int
    model_py: Path
    shm_region: str
    server_pid: int
    parent_pid: int  # now: init (or a subreaper) once the server that started it is gone
    rss_bytes: int

    @property
    def orphaned(self) -> bool:
        return self.parent_pid != self.server_pid


def read_stub(pid: int) -> Optional[Stub]:
    """The stub with this pid, or None when that process is not a running stub (or is gone already)."""
    try:
        argv = _argv(pid)  # [] once the process is gone: argv[0] below raises IndexError
        if Path(argv[0]).name != STUB_BINARY or len(argv) < 6 or not argv[5].isdigit():
            return None
        # comm may hold spaces and parentheses: the fields we need come after its closing ')'.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        state, parent_pid, rss_pages = fields[0], int(fields[1]), int(fields[21])
    except (OSError, IndexError, ValueError):
        return None
    if state in ("Z", "X"):  # exited; holds no memory, only waits for init to reap it
        return None
    return Stub(pid, Path(argv[1]), argv[2], int(argv[5]), parent_pid, rss_pages * os.sysconf("SC_PAGE_SIZE"))


def find_stubs() -> list[Stub]:
    return [stub for pid in _pids() if (stub := read_stub(pid)) is not None]


def _pids() -> Iterator[int]:
    proc = Path("/proc")
    return (int(entry.name) for entry in proc.iterdir() if entry.name.isdigit()) if proc.is_dir() else iter(())


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _may_map_regions(argv: list[str]) -> bool:
    """A server (or the wrapper about to exec one, server.py `dies_with_parent`) or a stub: the processes that map
    a repository's regions. The janitor that waits to clean up after a server (server.py `Janitor`) names its
    prefix too, and maps nothing: while its starter lived on, a dead server's region stayed "in use" for it
    (make test-stress under the hog, AMD EPYC Zen 3, session 31)."""
    return any(Path(arg).name in (SERVER_BINARY, STUB_BINARY) for arg in argv)


@dataclass
class Cleanup:
    """What was ended and removed, for one line of output."""

    stubs: int = 0
    rss_bytes: int = 0
    regions: int = 0
    region_bytes: int = 0
    servers: list[str] = field(default_factory=list)  # one phrase per orphaned server ended

    def __bool__(self) -> bool:
        return bool(self.stubs or self.regions or self.servers)

    def __add__(self, other: "Cleanup") -> "Cleanup":
        return Cleanup(self.stubs + other.stubs, self.rss_bytes + other.rss_bytes, self.regions + other.regions,
                       self.region_bytes + other.region_bytes, self.servers + other.servers)

    def describe(self) -> str:
        parts = []
        if self.servers:
            count = len(self.servers)
            parts.append(f"ended {count} orphaned tritonserver{'s' if count > 1 else ''} ({'; '.join(self.servers)})")
        if self.stubs:
            processes = f"{self.stubs} stub process{'es' if self.stubs > 1 else ''}"
            parts.append(f"ended {processes} ({_size(self.rss_bytes)} resident)")
        if self.regions:
            parts.append(f"removed {self.regions} shared-memory region{'s' if self.regions > 1 else ''} "
                         f"({_size(self.region_bytes)})")
        return ", ".join(parts) or "nothing to clean up"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.0f} MB"


def end_stubs(stubs: list[Stub], timeout_s: float = 5.0) -> None:
    """SIGKILL (a stub ignores SIGTERM), then wait until none of them runs."""
    for stub in stubs:
        try:
            os.kill(stub.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout_s
    while any(_running(stub) for stub in stubs) and time.monotonic() < deadline:
        time.sleep(0.02)


def _running(stub: Stub) -> bool:
    now = read_stub(stub.pid)
    return now is not None and now.shm_region == stub.shm_region  # not a new process that got the same pid


def remove_regions(names: Iterable[str]) -> tuple[int, int]:
    """Unlink /dev/shm/NAME for each name; returns (regions removed, bytes of memory they held)."""
    removed, held = 0, 0
    for name in set(names):
        path = SHM_DIR / name
        try:
            blocks = path.stat().st_blocks
            path.unlink()
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        removed, held = removed + 1, held + blocks * 512  # tmpfs pages really used (a region is sparse)
    return removed, held


def _clean(stubs: list[Stub], regions: Iterable[str]) -> Cleanup:
    end_stubs(stubs)
    removed, held = remove_regions([*regions, *(stub.shm_region for stub in stubs)])
    return Cleanup(len(stubs), sum(stub.rss_bytes for stub in stubs), removed, held)


# -- regions named per server: cleanup is exact ---------------------------------------------------------

def shm_prefix(repo: Path, token: str) -> str:
    """The region-name prefix a server on `repo` passes to the Python backend: the repository (hashed, so any
    path fits a file name) and a token of this server start. The backend appends a UUID per stub."""
    return f"{repository_prefix(repo)}{token}_"


def repository_prefix(repo: Path) -> str:
    return f"specpipe_{hashlib.sha1(str(Path(repo).resolve()).encode()).hexdigest()[:10]}_"


def clean_server(prefix: str) -> Cleanup:
    """After a server exited: end the stubs it started and remove its regions, all named with its `prefix`."""
    stubs = [stub for stub in find_stubs() if stub.shm_region.startswith(prefix)]
    return _clean(stubs, (path.name for path in SHM_DIR.glob(prefix + "*")))


def clean_leftovers(repo: Path) -> Cleanup:
    """Before a server starts on `repo`: end the stubs of an earlier server of this repository that no longer
    runs, and remove their regions and any region named for this repository whose server no longer runs."""
    repo = Path(repo).resolve()
    stubs = [stub for stub in find_stubs() if stub.orphaned and _inside(stub.model_py, repo)]
    own = re.compile(re.escape(repository_prefix(repo)) + f"[0-9a-f]{{{TOKEN_HEX}}}_")
    named = {path.name: match.group(0) for path in SHM_DIR.glob(repository_prefix(repo) + "*")
             if (match := own.match(path.name))}
    if named:  # a region is in use while its server (or one of its stubs) runs: its prefix is on their command line
        # ...but not the stubs ended here: a stopped stub kept a region of its dead server's "in use", and with it the
        # region a sibling stub left when its native exit won the race with our watchdog (make test-stress, Zen 3)
        ending = {stub.pid for stub in stubs}
        running = " ".join(" ".join(argv) for pid in _pids() if pid not in ending and _may_map_regions(argv := _argv(pid)))
        named = {name: prefix for name, prefix in named.items() if prefix not in running}
    return _clean(stubs, named)


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder)


# -- servers whose specpipe is gone ----------------------------------------------------------------------

SERVER_BINARY = "tritonserver"


def server_id(token: str) -> str:
    """The `--id` of a server this process starts: Triton's server metadata (GET /v2) answers it, so a readiness
    check knows the server it reaches is its own; and it names this process, so an orphan can be told."""
    return f"specpipe-{os.getpid()}-{token}"


_SERVER_ID = re.compile(r"--id=specpipe-(?P<starter>\d+)-(?P<token>[0-9a-f]+)$")


@dataclass(frozen=True)
class ServerProcess:
    """A running tritonserver that specpipe started (its --id says which specpipe process did)."""

    pid: int
    starter_pid: int
    parent_pid: int
    server_id: str
    repo: Path
    shm_prefix: str

    @property
    def orphaned(self) -> bool:
        """The specpipe that started it is gone: a server is re-parented (to init or a subreaper) when its parent dies."""
        return self.parent_pid != self.starter_pid


def read_server(pid: int) -> Optional[ServerProcess]:
    """The specpipe-started tritonserver with this pid, or None (not one, not ours to read, or exited)."""
    try:
        argv = _argv(pid)  # [] once the process is gone: argv[0] below raises IndexError
        if Path(argv[0]).name != SERVER_BINARY:
            return None
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    options = dict(arg[2:].split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)
    match = _SERVER_ID.match(f"--id={options.get('id', '')}")
    prefix = options.get("backend-config", "").partition("shm-region-prefix-name=")[2]
    if match is None or "model-repository" not in options:
        return None
    return ServerProcess(pid, int(match["starter"]), int(fields[1]), options["id"], Path(options["model-repository"]),
                         prefix)


def _serving(server: ServerProcess) -> bool:
    now = read_server(server.pid)
    return now is not None and now.server_id == server.server_id  # not a new process that got the same pid


def exited(pid: int) -> bool:
    """The process has let go of what it held: it is gone, or a zombie with no thread left. A killed multi-threaded
    process (tritonserver) reads as a zombie as soon as its main thread exits, while its other threads, which share
    its open sockets, may still be exiting: the next start then found its port held by "a process this user cannot
    see" (a zombie's /proc/<pid>/fd is empty; make test-stress under load, session 15)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X") and len(tasks) <= 1


def find_servers() -> list[ServerProcess]:
    return [server for pid in _pids() if (server := read_server(pid)) is not None]


def end_orphaned_servers(servers: list[ServerProcess], why: dict[int, str], timeout_s: float = 30.0) -> Cleanup:
    """SIGKILL each orphaned server's process group (the server and its stubs), wait until it is gone, then remove
    what its stubs left. `why` adds a phrase per pid (the port it held) to the one-line account."""
    ended = Cleanup()
    for server in servers:
        if not server.orphaned:
            raise ValueError(f"pid {server.pid} is not an orphan: its specpipe (pid {server.starter_pid}) runs")
        try:
            os.killpg(server.pid, signal.SIGKILL)  # started with its own session: group id = its pid
        except ProcessLookupError:
            pass
        except PermissionError:  # another user's: the caller names it as what holds the port
            continue
        deadline = time.monotonic() + timeout_s
        while (_serving(server) or not exited(server.pid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        ended += clean_server(server.shm_prefix) if server.shm_prefix else Cleanup()
        ended.servers.append(f"pid {server.pid} serving {server.repo}, whose specpipe (pid {server.starter_pid}) is "
                             f"gone" + (f"; {why[server.pid]}" if server.pid in why else ""))
    return ended


# -- in the stub ------------------------------------------------------------------------------------------

def exit_with_server(poll_s: float = 0.1) -> threading.Thread:
    """Called in a stub (model.py's initialize): exit as soon as the server that started it dies, removing
    this stub's region. The stub's own check waits until the server is reaped and can then deadlock with a
    request in flight (seen: a stub ran on for 34 minutes holding 1.1 GB). A dead server re-parents the stub
    at once, reaped or not; os._exit runs no destructors, so nothing can hang."""
    me = read_stub(os.getpid())
    server_pid = me.server_pid if me is not None else os.getppid()

    def watch() -> None:
        while os.getppid() == server_pid:
            time.sleep(poll_s)
        if me is not None:
            remove_regions([me.shm_region])
        os.write(2, f"specpipe: stub {os.getpid()} exits: its server (pid {server_pid}) is gone\n".encode())
        os._exit(1)

    thread = threading.Thread(target=watch, name="specpipe-exit-with-server", daemon=True)
    thread.start()
    return thread
