"""Process memory figures from ``/proc/self`` (Linux): resident and anonymous memory.

``Anonymous`` is memory the kernel cannot give back (heap, pre-packed weights); ``Rss`` also counts
clean pages mapped from model files, which the kernel can reclaim. Both matter on a 1.9 GB board.
"""

from __future__ import annotations

import dataclasses
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


def snapshot() -> MemorySnapshot:
    """Current ``Rss`` and ``Anonymous`` (0 where /proc is unavailable)."""
    f = _kb_fields("/proc/self/smaps_rollup")
    return MemorySnapshot(f.get("Rss", 0), f.get("Anonymous", 0))


def release_free_heap() -> None:
    """Give freed heap pages back to the kernel (glibc ``malloc_trim(0)``; no-op elsewhere).

    Call it before a baseline ``snapshot()``: memory freed earlier (e.g. by tokenizer loading) would
    otherwise be reused silently and make later growth look smaller than it is.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (``VmHWM``), bytes."""
    return _kb_fields("/proc/self/status").get("VmHWM", 0)
