"""What a server leaves behind, without a server: region bookkeeping and the stub's exit-with-server watchdog.
The real-server cases (kill -9 of tritonserver with a request in flight) are in test_triton_server.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import specpipe
from specpipe.triton.stubs import (SHM_DIR, Cleanup, _argv, clean_leftovers, clean_server, read_stub, repository_prefix,
                                   shm_prefix)

PROJECT_ROOT = Path(specpipe.__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")


def _region(name: str, size: int = 8192) -> Path:
    path = SHM_DIR / name
    path.write_bytes(b"\1" * size)
    return path


def test_leftover_regions_of_this_repository_go_and_those_in_use_or_of_others_stay(tmp_path):
    repo, other = tmp_path / "repo", tmp_path / "other"
    repo.mkdir(), other.mkdir()
    stale = _region(shm_prefix(repo, "0badcafe") + "uuid-1")
    in_use = _region(shm_prefix(repo, "00c0ffee") + "uuid-2")
    others = _region(shm_prefix(other, "0badcafe") + "uuid-3")
    # A running server whose command line names a prefix uses those regions: Python under tritonserver's name.
    holder = _naming(shm_prefix(repo, "00c0ffee"), name="/opt/tritonserver/bin/tritonserver")
    try:
        cleaned = clean_leftovers(repo)
        assert holder.poll() is None, f"premise: the holder exited early (status {holder.returncode})"
        assert (cleaned.stubs, cleaned.regions, cleaned.region_bytes) == (0, 1, 8192)
        assert not stale.exists() and in_use.exists() and others.exists()
    finally:
        holder.kill()
        holder.wait()
        for path in (stale, in_use, others):
            path.unlink(missing_ok=True)


def _naming(prefix: str, *, name: str) -> subprocess.Popen:
    """A process running as `name` (its argv[0]) whose command line names `prefix`, once it does."""
    process = subprocess.Popen([name, "-c", "import time; time.sleep(60)", prefix], executable=sys.executable)
    # Popen returns once the child's exec has closed its close-on-exec pipe, which the kernel does before it writes
    # the new program's arguments: for a moment /proc/PID/cmdline reads '' (seen under the hog: the in-use region
    # went). Wait for the exec to finish.
    deadline = time.monotonic() + 60
    while prefix not in " ".join(_argv(process.pid)):
        assert time.monotonic() < deadline and process.poll() is None, "premise: the command line names the prefix"
        time.sleep(0.01)
    return process


def test_a_dead_servers_janitor_does_not_keep_its_regions_in_use(tmp_path):
    """The process that waits to clean up after a server (server.py Janitor) names the server's prefix on its
    command line and lives as long as the server's starter: when the server died first, the next server of the
    repository must still remove what the dead one left (a stub that exited without removing its region)."""
    repo = tmp_path / "repo"
    prefix = shm_prefix(repo, "0dead0ff")
    left = _region(prefix + "uuid-1")
    janitor = _naming(prefix, name=sys.executable)  # a Python process, not a server or a stub
    try:
        cleaned = clean_leftovers(repo)
        assert janitor.poll() is None, f"premise: the janitor exited early (status {janitor.returncode})"
        assert (cleaned.stubs, cleaned.regions) == (0, 1) and not left.exists(), cleaned
    finally:
        janitor.kill()
        janitor.wait()
        left.unlink(missing_ok=True)


def _fake_stub(model_py: Path, region: str, server_pid: int) -> subprocess.Popen:
    """A process that reads as a stub (`triton_python_backend_stub MODEL_PY SHM_REGION ... SERVER_PID`): Python running
    model_py under the stub's name, its command line written once read_stub sees it."""
    model_py.parent.mkdir(parents=True, exist_ok=True)
    model_py.write_text("import time\ntime.sleep(120)\n")
    stub = subprocess.Popen(["/triton/triton_python_backend_stub", str(model_py), region, "1048576", "1048576",
                             str(server_pid)], executable=sys.executable)
    deadline = time.monotonic() + 60
    while read_stub(stub.pid) is None:  # the exec is done when the command line reads as a stub's (see above)
        assert time.monotonic() < deadline and stub.poll() is None, "premise: the fake stub reads as a stub"
        time.sleep(0.01)
    return stub


def test_a_stopped_orphan_stub_does_not_keep_its_siblings_region(tmp_path):
    """A dead server's two stubs: one left its region (its native exit beat our watchdog), the other is stopped and
    still runs. The next start ends the stopped one and removes both regions: the stub being ended does not make its
    server's prefix "in use"."""
    repo = tmp_path / "repo"
    prefix = shm_prefix(repo, "0dead0ff")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # the dead server: the stub's parent (this process) is not it, so the stub reads as orphaned
    left, held = _region(prefix + "sibling"), _region(prefix + "stopped")
    stub = _fake_stub(repo / "ensemble" / "1" / "model.py", held.name, gone.pid)
    try:
        os.kill(stub.pid, signal.SIGSTOP)
        cleaned = clean_leftovers(repo)
        assert cleaned.stubs == 1 and cleaned.regions == 2, cleaned
        assert not left.exists() and not held.exists() and stub.wait(60) == -signal.SIGKILL
    finally:
        stub.kill()
        stub.wait()
        for path in (left, held):
            path.unlink(missing_ok=True)


def test_clean_server_removes_exactly_its_own_regions(tmp_path):
    mine, theirs = shm_prefix(tmp_path, "11111111"), shm_prefix(tmp_path, "22222222")
    regions = [_region(mine + "a"), _region(mine + "b"), _region(theirs + "c")]
    try:
        assert clean_server(mine).regions == 2
        assert [path.exists() for path in regions] == [False, False, True]
    finally:
        for path in regions:
            path.unlink(missing_ok=True)


def test_region_prefix_names_the_repository_whatever_the_path_looks_like(tmp_path):
    weird = tmp_path / "a repo with spaces, ünïcode & / slashes"
    prefix = repository_prefix(weird)
    assert prefix.startswith("specpipe_") and "/" not in prefix and " " not in prefix and prefix.isascii()
    assert repository_prefix(weird) == prefix != repository_prefix(tmp_path / "another")
    assert shm_prefix(weird, "0123abcd") == prefix + "0123abcd_"


def test_cleanup_says_what_it_did_in_one_line():
    assert not Cleanup()
    line = Cleanup(stubs=2, rss_bytes=int(1.1 * 2**30), regions=1, region_bytes=2**20).describe()
    assert line == "ended 2 stub processes (1.10 GB resident), removed 1 shared-memory region (1 MB)"
    # The stub's own watchdog may have removed its region first: no "removed 0 regions".
    assert Cleanup(stubs=1, rss_bytes=150 * 2**20).describe() == "ended 1 stub process (150 MB resident)"


# A "server" process starts a "stub" that arms the watchdog, then keeps its main thread busy in Python.
_STUB = """
import sys, time
from specpipe.triton.stubs import exit_with_server
exit_with_server(poll_s=0.05)
print("armed", flush=True)
while True:
    sum(range(10000))
"""
_SERVER = """
import subprocess, sys, time
stub = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=sys.stdout)
print(stub.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.timing
def test_the_stub_watchdog_exits_the_stub_soon_after_its_server_dies():
    """The busy stub exits once its server is gone, and it is the watchdog that ends it (its line on stderr).
    How soon depends on the machine's load (poll_s plus scheduling): printed, not asserted; a stub without
    the watchdog runs on past the deadline and fails."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    server = subprocess.Popen([sys.executable, "-c", _SERVER, _STUB], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
    stub_pid = int(server.stdout.readline())
    try:
        assert server.stdout.readline().strip() == "armed"
        killed = time.monotonic()
        server.kill()
        server.wait()
        while _running(stub_pid) and time.monotonic() - killed < 120:
            time.sleep(0.01)
        assert not _running(stub_pid)
        print(f"stub exited {time.monotonic() - killed:.2f} s after its server was killed")
        assert f"specpipe: stub {stub_pid} exits: its server (pid {server.pid}) is gone" in server.stderr.read()
    finally:
        if _running(stub_pid):
            os.kill(stub_pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
