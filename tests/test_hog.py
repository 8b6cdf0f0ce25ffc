"""specpipe.testing.hog, the load `make test-stress` runs under: the command's exit code, and no loop left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _hog(*command: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "specpipe.testing.hog", "--cores", "1", "--", *command],
                            stderr=subprocess.PIPE, text=True, env=env)


def _loops(hog: subprocess.Popen) -> list[int]:
    for line in hog.stderr:
        if line.startswith("hog: loops "):
            return [int(pid) for pid in line.split()[2:]]
    raise AssertionError("the hog named no loops")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")  # a zombie has stopped spinning


def _gone(pids: list[int], deadline_s: float = 60) -> bool:
    deadline = time.monotonic() + deadline_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(pid) for pid in pids)


@pytest.mark.timing
def test_the_hog_returns_the_commands_exit_code_and_stops_its_loops():
    hog = _hog(sys.executable, "-c", "import sys; sys.exit(3)")
    loops = _loops(hog)
    assert hog.wait(timeout=120) == 3
    assert _gone(loops)


@pytest.mark.timing
def test_a_hog_killed_with_sigkill_leaves_no_loop_spinning():
    hog = _hog(sys.executable, "-c", "import time; time.sleep(600)")
    loops = _loops(hog)
    assert all(_alive(pid) for pid in loops)
    hog.send_signal(signal.SIGKILL)
    hog.wait()
    try:
        assert _gone(loops)  # each loop sees its parent gone at its next check
    finally:
        for pid in loops:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["pkill", "-f", "time.sleep(600)"], check=False)
