"""A CPU engine's weights in 2 MiB pages (Linux transparent huge pages).

A decode step streams every weight once: 540 MB for fp32 SmolLM2-135M, 132k pages of 4 KiB, each a TLB entry to
find again on the next step. ONNX Runtime copies (and prepacks) the weights into memory it allocates while the
session loads, and most Linux systems back such memory with huge pages only where a program asks
(/sys/kernel/mm/transparent_hugepage/enabled = madvise, the common default, and this machine's). So after the
session loads, the memory it added is advised MADV_HUGEPAGE and collapsed into huge pages at once with
MADV_COLLAPSE (Linux >= 6.1; madvise(2)). Measured (s38, Intel Emerald Rapids, 2 threads, fp32 SmolLM2-135M,
13 alternating process pairs, 3 x 128 decode steps each): 606-618 of ~650 MiB then in huge pages, median step
0.96x (faster in 10 of 13 pairs), collapsing takes ~0.5 s at load. Where the kernel cannot (older kernel, THP
disabled, not Linux) nothing changes and `HugePages.note` says why. SPECPIPE_HUGE_PAGES=0 turns it off.

Only memory that appeared while the session loaded is advised, not the rest of the process's.
"""

from __future__ import annotations

import ctypes
import errno
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h (asm-generic)
MADV_COLLAPSE = 25
ENV = "SPECPIPE_HUGE_PAGES"  # "0": leave the kernel's defaults


@dataclass
class HugePages:
    mib: int = 0  # memory collapsed into huge pages
    note: str = ""  # why none, where none


def anonymous_regions(maps_text: str) -> list[tuple[int, int]]:
    """[start, end) of each private writable anonymous mapping in a /proc/<pid>/maps text."""
    regions = []
    for line in maps_text.splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[1] == "rw-p":  # no path: anonymous
            start, end = (int(x, 16) for x in parts[0].split("-"))
            regions.append((start, end))
    return regions


def new_huge_ranges(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole 2 MiB pages of `after`'s regions that no region of `before` overlapped."""
    ranges = []
    for start, end in after:
        pieces = [(start, end)]
        for old_start, old_end in before:  # subtract what was already there
            pieces = [p for lo, hi in pieces
                      for p in ((lo, min(hi, old_start)), (max(lo, old_end), hi)) if p[0] < p[1]]
        for lo, hi in pieces:
            lo, hi = -(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE
            if hi > lo:
                ranges.append((lo, hi))
    return ranges


def _libc_madvise() -> Callable[[int, int, int], int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def madvise(address: int, length: int, advice: int) -> int:
        return 0 if libc.madvise(address, length, advice) == 0 else ctypes.get_errno()

    return madvise


@contextmanager
def huge_pages_for_new_memory(maps: Path = Path("/proc/self/maps"),
                              madvise: Optional[Callable[[int, int, int], int]] = None) -> Iterator[HugePages]:
    """Around a session's load: afterwards the anonymous memory it added is collapsed into huge pages, and the
    result says how much (or why none). `madvise(address, length, advice)` returns 0 or an errno (tests fake it)."""
    result = HugePages()
    if os.environ.get(ENV, "1") == "0":
        result.note = f"{ENV}=0"
        yield result
        return
    try:
        before = anonymous_regions(maps.read_text())
    except OSError:
        result.note = f"cannot read {maps} (not Linux?)"
        yield result
        return
    yield result
    try:
        ranges = new_huge_ranges(before, anonymous_regions(maps.read_text()))
        madvise = madvise or _libc_madvise()
    except (OSError, AttributeError) as exc:
        result.note = f"cannot advise the kernel: {exc}"
        return
    failed = 0
    for start, end in ranges:
        code = madvise(start, end - start, MADV_HUGEPAGE) or madvise(start, end - start, MADV_COLLAPSE)
        if code == 0:
            result.mib += (end - start) >> 20
        else:
            failed, reason = failed + 1, errno.errorcode.get(code, str(code))
    if failed:
        result.note = f"{failed} of {len(ranges)} regions not collapsed ({reason}; MADV_COLLAPSE needs Linux >= 6.1)"
    elif not ranges:
        result.note = "no whole 2 MiB page of new memory"
