"""Run a command while a busy loop spins on every core: how `make test-stress` loads the machine.

Tests that involve threads, servers or time must pass on a shared, loaded machine (CI shares its cores). This
loads every core at the command's own priority for as long as the command runs, then stops the loops and
exits with the command's exit code:

    python -m specpipe.testing.hog [--cores N] -- COMMAND [ARG ...]

A Python loop is enough: it takes a core from the scheduler like any other runnable process. stress-ng does
the same with more options, but it is a Debian package CI would have to install first.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys


def _spin(parent: int) -> None:
    """Busy until the hog that started it is gone: a hog ended by SIGKILL must not leave its loops spinning."""
    while os.getppid() == parent:
        for _ in range(1_000_000):  # tens of ms between checks
            pass


def run_loaded(command: list[str], cores: int) -> int:
    """Start `cores` busy loops, run `command` to its end, stop the loops; the command's exit code."""
    context = multiprocessing.get_context("spawn")
    hogs = [context.Process(target=_spin, args=(os.getpid(),), daemon=True) for _ in range(cores)]
    for hog in hogs:
        hog.start()
    print("hog: loops " + " ".join(str(hog.pid) for hog in hogs), file=sys.stderr, flush=True)
    try:
        return subprocess.call(command)
    finally:
        for hog in hogs:
            hog.kill()
            hog.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specpipe.testing.hog", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="busy loops to run (default: every core)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run under load, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if args.cores < 1:
        parser.error("--cores must be at least 1")
    print(f"hog: {args.cores} busy loop(s) while running: {' '.join(command)}", file=sys.stderr, flush=True)
    return run_loaded(command, args.cores)


if __name__ == "__main__":
    sys.exit(main())
