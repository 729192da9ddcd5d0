"""Process memory figures from ``/proc/self`` (Linux): resident and anonymous memory.

``Anonymous`` is memory the kernel cannot give back (heap, pre-packed weights); ``Rss`` also counts
clean pages mapped from model files, which the kernel can reclaim. Both matter on a 1.9 GB board.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class MemorySnapshot:
    """``Rss`` and ``Anonymous`` of this process, bytes (``/proc/self/smaps_rollup``)."""

    rss_bytes: int
    anonymous_bytes: int

    def __sub__(self, other: "MemorySnapshot") -> "MemorySnapshot":
        return MemorySnapshot(self.rss_bytes - other.rss_bytes, self.anonymous_bytes - other.anonymous_bytes)


def _kb_fields(path: str) -> dict[str, int]:
    fields = {}
    try:
        text = Path(path).read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[-1] == "kB":
            fields[parts[0].rstrip(":")] = int(parts[-2]) * 1024
    return fields


def available_bytes() -> int | None:
    """The kernel's estimate of memory available to a new allocation without swapping
    (``MemAvailable`` of ``/proc/meminfo``), or None where it is not reported."""
    return _kb_fields("/proc/meminfo").get("MemAvailable")


def snapshot() -> MemorySnapshot:
    """Current ``Rss`` and ``Anonymous`` (0 where /proc is unavailable)."""
    f = _kb_fields("/proc/self/smaps_rollup")
    return MemorySnapshot(f.get("Rss", 0), f.get("Anonymous", 0))


def release_free_heap() -> None:
    """Give freed heap pages back to the kernel (glibc ``malloc_trim(0)``; no-op elsewhere).

    Call it before a baseline ``snapshot()``: memory freed earlier (e.g. by tokenizer loading) would
    otherwise be reused silently and make later growth look smaller than it is.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    """glibc's ``malloc_trim``, or None. Looked up once: ``ctypes.util.find_library`` runs
    ``ldconfig -p`` in a subprocess (several ms), and the first decode step after every prompt
    trims."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (``VmHWM``), bytes."""
    return _kb_fields("/proc/self/status").get("VmHWM", 0)


#: ``madvise`` advice value (Linux ``include/uapi/asm-generic/mman-common.h``; the same on x86-64
#: and aarch64)
MADV_COLLAPSE = 25
#: size of one transparent huge page (PMD mapping): 2 MiB with 4 KiB base pages
HPAGE_PMD_SIZE_FILE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")


def anonymous_huge_ranges(maps_text: str, huge_page: int) -> list[tuple[int, int]]:
    """``(start, end)`` byte addresses, aligned to ``huge_page``, covered by the private writable
    anonymous mappings of a ``/proc/<pid>/maps`` text (no backing file; ``[heap]`` included, stacks
    and file mappings excluded). Mappings holding no whole aligned huge page are left out."""
    ranges = []
    for line in maps_text.splitlines():
        parts = line.split()
        if len(parts) < 5:
            continue
        path = parts[5] if len(parts) > 5 else ""
        if not parts[1].startswith("rw") or parts[1][3:4] != "p" or parts[4] != "0" or path not in ("", "[heap]"):
            continue
        low, high = (int(x, 16) for x in parts[0].split("-"))
        start, end = -(-low // huge_page) * huge_page, high // huge_page * huge_page
        if end > start:
            ranges.append((start, end))
    return ranges


def collapse_to_huge_pages() -> int:
    """Move this process's large anonymous memory onto transparent huge pages, in place.

    For each huge page of :func:`anonymous_huge_ranges` whose small pages are all resident
    (``mincore``): ``madvise(MADV_COLLAPSE)`` (Linux ≥ 6.1: the kernel copies them into one huge page
    now, whatever the system's THP mode other than ``never``). Partly used huge pages are left alone,
    and no ``MADV_HUGEPAGE`` is set for later faults: either would add resident memory (28 MB of
    Anonymous memory on the int8 270M, 1.26 × the archive instead of 1.16 ×). Call it after
    onnxruntime has packed its weights on the heap: a decode step reads all of them, and with 2 MiB
    pages it takes far fewer TLB misses (int8 270M on x86-64: 0.79–0.80 × the decode time of the
    plain heap on 2026-12-02; ``docs/benchmarks.md``). Contents, Rss and Anonymous memory do not
    change. Pages the kernel refuses (no THP, an older kernel, no free huge
    page) are left as they are.

    Returns:
        the growth of ``AnonHugePages`` (``/proc/self/smaps_rollup``), bytes; 0 where unsupported.
    """
    import ctypes
    import mmap

    try:
        huge_page = int(HPAGE_PMD_SIZE_FILE.read_text())
        maps = Path("/proc/self/maps").read_text()
        libc = ctypes.CDLL(None, use_errno=True)
        madvise, mincore = libc.madvise, libc.mincore
    except (OSError, ValueError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    resident = (ctypes.c_ubyte * (huge_page // mmap.PAGESIZE))()
    before = _kb_fields("/proc/self/smaps_rollup").get("AnonHugePages", 0)
    for start, end in anonymous_huge_ranges(maps, huge_page):
        for page in range(start, end, huge_page):  # one by one: a refused page does not stop the rest
            # only huge pages whose small pages are all resident already: collapsing a partly used
            # one would fill its holes (about 30 MB more Anonymous memory for the int8 270M)
            if mincore(page, huge_page, resident) == 0 and all(bit & 1 for bit in bytes(resident)):
                madvise(page, huge_page, MADV_COLLAPSE)
    return max(0, _kb_fields("/proc/self/smaps_rollup").get("AnonHugePages", 0) - before)
