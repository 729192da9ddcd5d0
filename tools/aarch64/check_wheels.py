"""Do the toolkit's runtime dependencies install as binary wheels on the board's Python?

The emulated board (``tools/aarch64/run.sh``) runs Debian's Python 3.13; the SL2610 runs Python 3.12.
This asks pip to resolve ``pyproject.toml``'s ``dependencies`` as wheels only, for CPython of the given
version on manylinux aarch64, without installing anything, and prints each wheel with the glibc its
tag needs. No source builds on the board: a dependency without such a wheel fails the check.

Usage:
    python tools/aarch64/check_wheels.py [--python 3.12] [--arch aarch64]

Exit status 0 when every dependency resolved; 1 when pip could not resolve them (its last line is
printed); 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: manylinux tags pip may accept for the board, oldest first (PEP 600 names and their legacy aliases)
PLATFORMS = ("manylinux2014_{arch}", "manylinux_2_17_{arch}", "manylinux_2_24_{arch}", "manylinux_2_27_{arch}",
             "manylinux_2_28_{arch}", "manylinux_2_31_{arch}", "manylinux_2_34_{arch}", "manylinux_2_35_{arch}")
#: machines with manylinux wheels of onnxruntime
ARCHES = ("aarch64", "x86_64")
_LEGACY = {"manylinux2014": (2, 17), "manylinux2010": (2, 12), "manylinux1": (2, 5)}


def runtime_dependencies(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The ``[project] dependencies`` requirement strings of ``pyproject``."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise SystemExit("error: tools/aarch64/check_wheels.py needs Python 3.11 or newer (tomllib)") from None
    return list(tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"])


def glibc_needed(wheel_name: str) -> tuple[int, int] | None:
    """The oldest glibc a wheel's platform tags accept, e.g. ``(2, 28)`` for ``…-manylinux_2_28_aarch64.whl``;
    None for a pure-Python (``any``) wheel. A wheel listing several manylinux tags installs where any
    one of them does, so the smallest version counts."""
    platform = wheel_name.removesuffix(".whl").split("-")[-1]
    if platform == "any":
        return None
    versions = []
    for tag in platform.split("."):
        match = re.match(r"manylinux_(\d+)_(\d+)_", tag)
        if match:
            versions.append((int(match[1]), int(match[2])))
        elif tag.split("_")[0] in _LEGACY:
            versions.append(_LEGACY[tag.split("_")[0]])
    return min(versions) if versions else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default="3.12", help="the board's Python version (default 3.12)")
    parser.add_argument("--arch", default="aarch64", help="the board's machine (default aarch64)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python):
        print(f"error: --python {args.python!r}: expected a version like 3.12", file=sys.stderr)
        return 2
    if args.arch not in ARCHES:
        print(f"error: --arch {args.arch!r}: expected one of {', '.join(ARCHES)}", file=sys.stderr)
        return 2
    abi = "cp" + args.python.replace(".", "")
    requirements = runtime_dependencies()
    with tempfile.TemporaryDirectory(prefix="gx-wheels-") as dest:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", dest, "--only-binary=:all:",
                   "--python-version", args.python, "--implementation", "cp", "--abi", abi, "--abi", "abi3",
                   "--abi", "none"]
        for platform in PLATFORMS:
            command += ["--platform", platform.format(arch=args.arch)]
        proc = subprocess.run(command + requirements, capture_output=True, text=True)
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")] or proc.stderr.splitlines()
            print(f"error: the dependencies do not resolve as {abi} {args.arch} wheels: "
                  f"{errors[-1] if errors else 'pip failed'}", file=sys.stderr)
            return 1
        wheels = sorted(p.name for p in Path(dest).glob("*.whl"))
    needed = [glibc_needed(w) for w in wheels]
    for wheel, glibc in zip(wheels, needed):
        print(f"  {wheel}  ({'any platform' if glibc is None else f'glibc >= {glibc[0]}.{glibc[1]}'})")
    newest = max((g for g in needed if g is not None), default=None)
    print(f"{len(requirements)} dependencies resolved to {len(wheels)} wheels for CPython {args.python} on {args.arch}"
          + (f"; the board needs glibc >= {newest[0]}.{newest[1]}" if newest else ""))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # one line and the shell's status, as the other tools (pip's download is its child)
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
