"""The engine's weights in huge pages (specpipe/engines/huge_pages.py): which memory is advised, what a refusal
says, and that the kernel's own answer is what the result reports."""

import re
from pathlib import Path

import numpy as np

from specpipe.engines import huge_pages as hp

MIB = 1 << 20


def maps_line(start: int, end: int, path: str = "") -> str:
    return f"{start:x}-{end:x} rw-p 00000000 00:00 0" + (f"                          {path}" if path else "")


def test_only_whole_huge_pages_of_memory_that_is_new():
    before = [(1 * MIB, 3 * MIB), (20 * MIB, 22 * MIB)]
    after = [(1 * MIB, 9 * MIB), (20 * MIB, 22 * MIB), (30 * MIB, 31 * MIB)]
    # [1, 3) was there: the new [3, 9) holds whole 2 MiB pages [4, 8); [20, 22) is old; [30, 31) has no whole page
    assert hp.new_huge_ranges(before, after) == [(4 * MIB, 8 * MIB)]
    assert hp.new_huge_ranges([], [(0, 6 * MIB)]) == [(0, 6 * MIB)]


def test_anonymous_private_writable_mappings_only():
    text = "\n".join([maps_line(0x400000, 0x800000), maps_line(0x800000, 0xc00000, "/usr/lib/libx.so"),
                      "c00000-1000000 r--p 00000000 00:00 0", maps_line(0x1000000, 0x1400000, "[heap]")])
    assert hp.anonymous_regions(text) == [(0x400000, 0x800000)]


def fake_loading(tmp_path: Path, answers: dict[int, int]):
    maps, calls = tmp_path / "maps", []
    maps.write_text(maps_line(2 * MIB, 4 * MIB))

    def madvise(address, length, advice):
        calls.append((address, length, advice))
        return answers.get(advice, 0)

    return maps, calls, madvise


def test_the_memory_a_load_added_is_advised_then_collapsed(tmp_path, monkeypatch):
    monkeypatch.delenv(hp.ENV, raising=False)
    maps, calls, madvise = fake_loading(tmp_path, {})
    with hp.huge_pages_for_new_memory(maps, madvise) as result:
        maps.write_text(maps_line(2 * MIB, 4 * MIB) + "\n" + maps_line(8 * MIB, 13 * MIB))  # the session loads
    assert calls == [(8 * MIB, 4 * MIB, hp.MADV_HUGEPAGE), (8 * MIB, 4 * MIB, hp.MADV_COLLAPSE)]
    assert (result.mib, result.note) == (4, "")


def test_a_kernel_that_cannot_collapse_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv(hp.ENV, raising=False)
    maps, calls, madvise = fake_loading(tmp_path, {hp.MADV_COLLAPSE: 22})
    with hp.huge_pages_for_new_memory(maps, madvise) as result:
        maps.write_text(maps_line(2 * MIB, 4 * MIB) + "\n" + maps_line(8 * MIB, 12 * MIB))
    assert result.mib == 0 and "EINVAL" in result.note and "Linux >= 6.1" in result.note


def test_turned_off_it_asks_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(hp.ENV, "0")
    maps, calls, madvise = fake_loading(tmp_path, {})
    with hp.huge_pages_for_new_memory(maps, madvise) as result:
        maps.write_text(maps_line(2 * MIB, 4 * MIB) + "\n" + maps_line(8 * MIB, 12 * MIB))
    assert calls == [] and result.mib == 0 and hp.ENV in result.note


def test_the_real_kernel_agrees_with_the_result(monkeypatch):
    """Whatever this kernel does: memory reported collapsed shows as AnonHugePages in smaps, and a kernel that
    collapsed nothing says why."""
    monkeypatch.delenv(hp.ENV, raising=False)
    with hp.huge_pages_for_new_memory() as result:
        weights = np.ones(64 * MIB // 8)  # 64 MiB of new anonymous memory, written
    if result.mib == 0 or result.note:  # collapsed nothing, or not all of it: then it must say why
        assert result.note
        return
    start = weights.__array_interface__["data"][0]
    smaps = Path("/proc/self/smaps").read_text()
    huge = 0
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps):
        lo, hi = (int(x, 16) for x in block.split()[0].split("-"))
        if lo <= start < hi or start <= lo < start + weights.nbytes:
            huge += int(re.search(r"AnonHugePages:\s+(\d+) kB", block).group(1)) // 1024
    assert huge >= 32  # most of the array's 64 MiB
