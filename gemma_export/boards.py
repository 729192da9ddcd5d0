"""The boards this toolkit targets: one table read by ``bench --board`` and by ``bundle``.

The SL2610's figures are the board team's (issue #8 and ``../shared/reference-format.md``): two
Cortex-A55 cores, about 1.9 GB of RAM usable by the model process, Python 3.12, aarch64 Linux.
"""

from __future__ import annotations

import dataclasses
import re

from .errors import ConfigError


#: a PEP 600 platform tag: glibc major, minor and the machine (``manylinux_2_28_aarch64``)
MANYLINUX = re.compile(r"manylinux_(\d+)_(\d+)_(\w+)")


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
        match = MANYLINUX.fullmatch(self.platforms[0]) if self.platforms else None
        if match is None:
            return "wheels for the board's platform"
        major, minor, arch = match.groups()
        return f"{arch} wheels, which need glibc {major}.{minor} or newer"

    def wheel_tag_problem(self, filename: str) -> str | None:
        """Why pip on the board would refuse a wheel of this file name, or None when its tags fit.

        The name is ``NAME-VERSION[-BUILD]-PYTHON-ABI-PLATFORM.whl`` (PEP 427; each tag may hold
        several, joined by dots). The board's pip takes a Python tag ``py3``, ``py3N`` (N up to the
        board's minor version), ``cpXY`` of its own version, or with the ABI ``abi3`` ``cp3N`` up to
        its own; the ABI ``none``, ``abi3`` or its own; a platform ``any``, one of :attr:`platforms`, ``linux_ARCH``, or
        ``manylinux_X_Y_ARCH`` with a glibc no newer than the first platform's (PEP 600). A name
        whose parts cannot be read is reported as such.
        """
        parts = filename[:-len(".whl")].split("-") if filename.endswith(".whl") else []
        if len(parts) not in (5, 6):
            return f"the name '{filename}' is not NAME-VERSION-PYTHON-ABI-PLATFORM.whl"
        python_tags, abi_tags, platform_tags = (tag.split(".") for tag in parts[-3:])
        major, minor = self.python.split(".")
        own = f"cp{major}{minor}"
        def version_up_to_ours(tag: str, prefix: str) -> bool:  # py3N / cp3N with N at most the board's minor
            found = re.fullmatch(rf"{prefix}{major}(\d+)", tag)
            return found is not None and int(found.group(1)) <= int(minor)

        stable = "abi3" in abi_tags  # a stable-ABI wheel of an older CPython 3 installs on a newer one (PEP 384)
        fits_python = any(tag == f"py{major}" or tag == own or version_up_to_ours(tag, "py")
                          or (stable and version_up_to_ours(tag, "cp")) for tag in python_tags)
        if not fits_python:
            return (f"its Python tag '{parts[-3]}' is not one the board's CPython {self.python} installs "
                    f"(py{major}, py{major}N or {own}; cp{major}N up to it with abi3)")
        if not any(tag in ("none", "abi3", own) for tag in abi_tags):
            return f"its ABI tag '{parts[-2]}' is not one the board's CPython {self.python} installs (none, abi3, {own})"
        newest = MANYLINUX.fullmatch(self.platforms[0]) if self.platforms else None

        def fits(tag: str) -> bool:
            if tag == "any" or tag in self.platforms:
                return True
            if newest is None:
                return False
            glibc, arch = (int(newest.group(1)), int(newest.group(2))), newest.group(3)
            if tag == f"linux_{arch}":
                return True
            match = MANYLINUX.fullmatch(tag)
            return match is not None and match.group(3) == arch and (int(match.group(1)), int(match.group(2))) <= glibc

        if not any(fits(tag) for tag in platform_tags):
            older = (f", or another {newest.group(3)} manylinux tag of glibc {newest.group(1)}.{newest.group(2)} or "
                     "older" if newest else "")
            return f"its platform tag '{parts[-1]}' is not one the board installs (any, {', '.join(self.platforms)}{older})"
        return None


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
