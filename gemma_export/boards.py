"""The boards this toolkit targets: one table read by ``bench --board`` and by ``bundle``.

The SL2610's figures are the board team's (issue #8 and ``../shared/reference-format.md``): two
Cortex-A55 cores, about 1.9 GB of RAM usable by the model process, Python 3.12, aarch64 Linux.
"""

from __future__ import annotations

import dataclasses
import re

from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Board:
    """One target board.

    Attributes:
        title: how the bundle README names the board.
        threads: onnxruntime intra-op threads to use (the board's cores).
        memory_bytes: RAM usable by the model process, bytes.
        headroom_bytes: bytes of ``memory_bytes`` that must stay free at peak (``bench --board``).
        python: the board's CPython version, ``"3.12"``: which wheels pip picks for it.
        platforms: pip ``--platform`` tags its wheels may have (newest glibc first).
    """

    title: str
    threads: int
    memory_bytes: int
    headroom_bytes: int
    python: str
    platforms: tuple[str, ...]

    @property
    def wheel_requirements(self) -> str:
        """What the newest platform tag asks of the board, e.g. ``"aarch64 wheels, which need glibc
        2.28 or newer"`` for ``manylinux_2_28_aarch64``."""
        match = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", self.platforms[0]) if self.platforms else None
        if match is None:
            return "wheels for the board's platform"
        major, minor, arch = match.groups()
        return f"{arch} wheels, which need glibc {major}.{minor} or newer"


BOARDS = {
    "sl2610": Board(
        title="Synaptics Astra SL2610 (2 x Cortex-A55, aarch64 Linux, ~1.9 GB usable RAM)",
        threads=2, memory_bytes=1_900_000_000, headroom_bytes=300_000_000, python="3.12",
        platforms=("manylinux_2_28_aarch64", "manylinux2014_aarch64"),  # what pip may take for its glibc
    ),
}

#: the board bench's default threads and bundle's default target come from
DEFAULT_BOARD = "sl2610"
#: intra-op threads without --threads or --board: the default board's cores
DEFAULT_THREADS = BOARDS[DEFAULT_BOARD].threads


def board(name: str) -> Board:
    """The board called ``name`` (a key of :data:`BOARDS`).

    Raises:
        ConfigError: ``name`` is not a known board (the message lists the known ones).
    """
    if name not in BOARDS:
        raise ConfigError(f"--board: unknown board {name!r}; known: {', '.join(BOARDS)}")
    return BOARDS[name]
