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
        several, joined by dots: the wheel fits when one combination does). The combinations the
        board's CPython takes, as pip lists them (``packaging.tags``): its own ``cpXY`` with its own
        ABI, or with ``abi3`` a ``cp3N`` up to its own, each on a platform of the board; ``py3``,
        ``py3N`` (N up to its minor version) or its ``cpXY`` with the ABI ``none``, on a platform of
        the board or ``any``. The board's platforms: :attr:`platforms`, ``linux_ARCH``, and
        ``manylinux_X_Y_ARCH`` from the oldest glibc of :attr:`platforms` (2.17 for
        ``manylinux2014``) to the newest (PEP 600). A name whose parts cannot be read is reported as
        such.
        """
        parts = filename[:-len(".whl")].split("-") if filename.endswith(".whl") else []
        if len(parts) not in (5, 6):
            return f"the name '{filename}' is not NAME-VERSION-PYTHON-ABI-PLATFORM.whl"
        python_tags, abi_tags, platform_tags = (tag.split(".") for tag in parts[-3:])
        major, minor = self.python.split(".")
        own = f"cp{major}{minor}"
        newest = MANYLINUX.fullmatch(self.platforms[0]) if self.platforms else None  # its glibc and machine
        oldest = self.oldest_glibc

        def version_up_to_ours(tag: str, prefix: str) -> bool:  # py3N / cp3N with N at most the board's minor
            found = re.fullmatch(rf"{prefix}{major}(\d+)", tag)
            return found is not None and int(found.group(1)) <= int(minor)

        def board_platform(tag: str) -> bool:  # not "any"
            if tag in self.platforms:
                return True
            if newest is None:
                return False
            arch = newest.group(3)
            found = MANYLINUX.fullmatch(tag)
            glibc = found and (int(found.group(1)), int(found.group(2)))
            return tag == f"linux_{arch}" or (found is not None and found.group(3) == arch
                                              and oldest <= glibc <= (int(newest.group(1)), int(newest.group(2))))

        def fits(python: str, abi: str, platform: str) -> bool:
            if abi == own:
                return python == own and board_platform(platform)
            if abi == "abi3":
                return version_up_to_ours(python, "cp") and board_platform(platform)
            if abi == "none":
                return (python in (f"py{major}", own) or version_up_to_ours(python, "py")) and \
                    (platform == "any" or board_platform(platform))
            return False

        if any(fits(py, abi, plat) for py in python_tags for abi in abi_tags for plat in platform_tags):
            return None
        # the first part no combination can use, for the message
        if not any(tag in (f"py{major}", own) or version_up_to_ours(tag, "py") or version_up_to_ours(tag, "cp")
                   for tag in python_tags):
            return (f"its Python tag '{parts[-3]}' is not one the board's CPython {self.python} installs "
                    f"(py{major}, py{major}N or {own}; cp{major}N up to it with abi3)")
        if not any(tag in ("none", "abi3", own) for tag in abi_tags):
            return f"its ABI tag '{parts[-2]}' is not one the board's CPython {self.python} installs (none, abi3, {own})"
        if not any(tag == "any" or board_platform(tag) for tag in platform_tags):
            glibc = (f", or another {newest.group(3)} manylinux tag of glibc {oldest[0]}.{oldest[1]} "
                     f"to {newest.group(1)}.{newest.group(2)}" if newest else "")
            return f"its platform tag '{parts[-1]}' is not one the board installs (any, {', '.join(self.platforms)}{glibc})"
        return (f"its tags '{'-'.join(parts[-3:])}' pair no Python, ABI and platform the board's CPython {self.python} "
                f"installs together ({own} with {own} or abi3 on the board's platform; py{major} with none, also on any)")

    @property
    def oldest_glibc(self) -> tuple[int, int]:
        """The oldest glibc a wheel for the board may ask for: that of the oldest of :attr:`platforms`
        (``manylinux2014``: 2.17, the first manylinux for aarch64)."""
        versions = []
        for tag in self.platforms:
            found = MANYLINUX.fullmatch(tag)
            if found:
                versions.append((int(found.group(1)), int(found.group(2))))
            elif tag.split("_")[0] in LEGACY_MANYLINUX:
                versions.append(LEGACY_MANYLINUX[tag.split("_")[0]])
        return min(versions) if versions else (0, 0)


#: PEP 600's glibc for the manylinux tags before it
LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


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
