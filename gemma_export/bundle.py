"""``gemma-export bundle``: the folder a board team copies to the board and runs.

Layout of ``BOARD_DIR`` (and nothing else)::

    model/                         the export, re-verified against its manifest.json
    gemma_export-<ver>-py3-none-any.whl   this toolkit, pure Python (its dependencies come from PyPI)
    README.md                      install line for the board's Python; verify, prepack, generate, bench commands
    BUNDLE.json                    sha256 and size of every file above

The bundle is written into a staging folder beside ``BOARD_DIR`` and moved into place only when
complete, so a failure leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable

from . import __version__
from .boards import BOARDS, DEFAULT_BOARD, Board, board as find_board
from .config import QUANTIZED_DTYPES
from .errors import FormatError, GemmaExportError, OutputError, SourceNotFoundError, check_arguments, shown
from .manifest import export_description, quantization_text
from .onnx_files import BUNDLE_MANIFEST, BUNDLE_MODEL_DIR
from .text_files import non_regular, read_bounded

#: what the toolkit's wheel is built from (pyproject.toml's packages and readme)
WHEEL_SOURCES = ("pyproject.toml", "README.md", "gemma_export", "quant")


@dataclasses.dataclass
class BundleResult:
    """The board folder written by :func:`write_bundle` and its files (path relative to it → bytes)."""

    out_dir: Path
    files: dict[str, int]  # relative path -> bytes

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def _project_root() -> Path | None:
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "gemma_export").is_dir() else None


#: room the free-space check keeps for a wheel built here, bytes: the build's scratch copy of the
#: sources beside the bundle peaked at 8.8 MB (2026-12-05), the wheel it leaves is ~0.2 MB
WHEEL_BYTES_ESTIMATE = 16 * 10**6


def _pip_wheel_command(tree: Path, dest: Path) -> list[str]:
    # the tree as a file:// URL: pip reads a ';' in a plain path (the bundle folder's name is in it)
    # as the start of an environment marker
    return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(dest), tree.as_uri()]


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies, which write nothing, do not count);
    read from ``/proc/*/stat`` (Linux)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _run_in_own_group(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``command`` (output captured) in a process group of its own. If this process is
    interrupted meanwhile (Ctrl-C, or SIGTERM raised as an exception by the CLI), the whole group is
    killed (pip and the build backend it started, which a kill of pip alone leaves running) and
    gone before the exception goes on, so nothing still writes into the folder being removed. On
    Linux the command also dies with this process (``PR_SET_PDEATHSIG``), e.g. when it is SIGKILLed
    and no handler runs."""
    if sys.platform == "linux":  # set in the child by a launcher that then execs the command (no preexec_fn,
        command = [sys.executable, "-c", _DIE_WITH_PARENT, *command]  # which is unsafe in a threaded process)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 5
        while _group_running(proc.pid) and time.monotonic() < deadline:  # killed orphans take a moment
            time.sleep(0.02)
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


#: the launcher :func:`_run_in_own_group` runs a command through on Linux: SIGKILL when its parent
#: dies (``prctl(PR_SET_PDEATHSIG)``, kept across exec), then the command itself
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                    "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
                    "if os.getppid() == 1: sys.exit(1)\n"  # the parent died before the prctl took effect
                    "os.execvp(sys.argv[1], sys.argv[1:])\n")


def build_wheel(dest: Path, scratch_dir: Path | None = None) -> Path:
    """Build this toolkit's wheel into ``dest`` with pip (no dependencies bundled), from a copy of
    its sources in a scratch folder made in ``scratch_dir`` (default: the system's temporary folder).

    Raises:
        SourceNotFoundError: the toolkit is not installed from a source tree (pass a wheel instead).
        GemmaExportError: pip failed (its last line is in the message).
    """
    root = _project_root()
    if root is None:
        raise SourceNotFoundError("bundle: the toolkit's source tree (pyproject.toml) is not beside the installed "
                                  "package; pass --wheel PATH to a gemma_export wheel")
    # built from a copy of what the wheel holds, so setuptools' build/ and *.egg-info folders land in
    # the temporary copy instead of the user's checkout
    scratch = tempfile.mkdtemp(prefix="gemma-export-wheel-", dir=scratch_dir)
    try:  # whatever happens (an interrupt included), the scratch folder goes, once pip's group is gone
        tree = Path(scratch) / "src"
        try:
            tree.mkdir()
            for name in WHEEL_SOURCES:
                if (root / name).is_dir():
                    shutil.copytree(root / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy2(root / name, tree / name)
        except (OSError, shutil.Error) as exc:  # copytree gathers its failures in a list: name the first
            first = exc.args[0][0][2] if isinstance(exc, shutil.Error) and exc.args and exc.args[0] else exc
            reason = getattr(first, "strerror", None) or str(first).split(": ", 1)[0]
            hint = ("free space in the temporary folder or point TMPDIR elsewhere" if scratch_dir is None
                    else "free space where the bundle is written (--out), or choose another --out")
            raise GemmaExportError(f"bundle: cannot copy the toolkit's sources into {scratch} to build its wheel "
                                   f"({reason}); {hint}") from None
        # pip's own temporary folders go into the scratch folder too, so an interrupted build
        # (Ctrl-C kills pip mid-build) leaves none of them in the system's temporary folder
        pip_tmp = Path(scratch) / "tmp"
        pip_tmp.mkdir()
        proc = _run_in_own_group(_pip_wheel_command(tree, dest), {**os.environ, "TMPDIR": str(pip_tmp)})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wheels = sorted(dest.glob("gemma_export-*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        output = f"{proc.stdout}\n{proc.stderr}"
        if "No space left on device" in output or "[Errno 28]" in output:  # pip's last line hides it
            # the bundle builds in its own staging folder (deleted by the time this is read): name --out
            hint = ("free space where the bundle is written (--out), or choose another --out" if scratch_dir is not None
                    else f"free space in {dest} and the temporary folder, or point TMPDIR elsewhere")
            raise GemmaExportError(f"bundle: building the gemma_export wheel from {root} failed: no space left on "
                                   f"device; {hint}")
        # pip's last lines are often its "note:" / "hint:" boilerplate: the last line that is not
        lines = [line.strip() for line in proc.stderr.splitlines()
                 if line.strip() and not line.strip().startswith(("note:", "hint:"))]
        raise GemmaExportError(f"bundle: building the gemma_export wheel from {root} failed: "
                               f"{(lines or ['no output'])[-1]}")
    return wheels[0]


def _readme(board: str, spec: Board, wheel: str, model_manifest: dict) -> str:
    python, threads = f"Python {spec.python}", spec.threads
    platforms = " ".join(f"--platform {tag}" for tag in spec.platforms)
    headroom_mb = spec.headroom_bytes // 1_000_000
    config = model_manifest.get("config", {})
    dtype = model_manifest.get("dtype", "?")
    quantized = dtype in QUANTIZED_DTYPES  # float weights: no pre-packed copy (it would be 2-4 x the model)
    prepack_step = "pre-pack the weights for this board's CPU, " if quantized else ""
    prepack_line = "    ~/gx/bin/gemma-export prepack --model model\n" if quantized else ""
    memory = (QUANTIZED_MEMORY.format(**QUANTIZED_MEMORY_FIGURES[dtype]) if quantized
              else FLOAT_MEMORY.format(dtype=dtype, peak=BF16_PEAK_GB))
    how, float16 = quantization_text(model_manifest) if quantized else ("", "")
    if not quantized:  # said first: the commands below include a `bench --board` that fails on the board
        float16 = (f"**Too large for the {board}'s memory:** onnxruntime holds {dtype} weights as float32, and the "
                   f"270M's bf16 export peaked at {BF16_PEAK_GB[0]}–{BF16_PEAK_GB[1]} GB in `bench --board {board}` "
                   f"on x86-64, over the board's {spec.memory_bytes / 1e9:.1f} GB, so the `bench` below fails there. "
                   "The int8 or int4 export is the one for the board; this one is for comparison.")
        float16 = textwrap.fill(float16, 100) + "\n\n"
    return f"""# gemma-export bundle for the {spec.title}

Model: Gemma 3, {config.get('num_hidden_layers', '?')} layers, vocabulary {config.get('vocab_size', '?')}, weights {dtype}{how};
exported by gemma-export {__version__}. Every file of this folder is listed with its sha256 in
`{BUNDLE_MANIFEST}`; `model/manifest.json` lists the model's own files.

{float16}Install from inside this folder (once, with the board's {python}, whose `venv` module Debian and
Ubuntu ship as `python3-venv`; the toolkit's dependencies, onnxruntime included, come from PyPI as
{spec.wheel_requirements}: `ldd --version` shows the board's glibc):

    python3 -m venv ~/gx && ~/gx/bin/pip install --force-reinstall --no-deps ./{wheel} && ~/gx/bin/pip install ./{wheel}

(The first `pip install` replaces a toolkit an earlier bundle installed: its version number is the
same while the code may differ, and pip would keep the old one. The second brings the dependencies.)

No network on the board? On a machine with one (any OS or CPU), from this folder, download the
same wheels for the board's Python (about 70 MB) into a folder beside it, not inside it (`verify`
refuses files the bundle does not list):

```sh
pip download --only-binary=:all: {platforms} --python-version {spec.python} --implementation cp -d ../gx-wheels ./{wheel}
```

Copy `gx-wheels` to the board as `~/wheels`, then install from it instead:

```sh
python3 -m venv ~/gx && ~/gx/bin/pip install --force-reinstall --no-deps ./{wheel} && ~/gx/bin/pip install --no-index --find-links ~/wheels ./{wheel}
```

From inside this folder, check every file against `{BUNDLE_MANIFEST}` and the model, {prepack_step}then
generate and benchmark with the board's {threads} threads:

    ~/gx/bin/gemma-export verify .
{prepack_line}    ~/gx/bin/gemma-export generate --model model --threads {threads} --prompt "The capital of France is"
    ~/gx/bin/gemma-export bench --model model --board {board} --json ~/bench.json

A pre-trained model, such as the Gemma 3 270M bundled with the toolkit, continues the prompt; an
instruction-tuned one, such as FunctionGemma, answers a turn written out with its control tokens
(`<start_of_turn>user ... <end_of_turn>`; `gemma-export generate --help` says how control tokens
are read).

An application of your own that runs `model/model.onnx` with onnxruntime directly finds the inputs,
the prompt's ids and the KV cache rules in `docs/integration.md` of the gemma-export source tree
(the tree this folder's wheel was built from; neither this folder nor the wheel holds it); the
tree's `tools/plain_onnxruntime.py` is the same as a short script (onnxruntime, tokenizers and numpy).

{memory} `bench` fails with a message (exit status 1) if peak memory leaves less than {headroom_mb} MB of the
board's memory free.
"""


#: the bundle README's memory paragraph for int8 / int4 weights
QUANTIZED_MEMORY = """`prepack` writes `model/prepacked/` (about twice the model's size on disk): onnxruntime's graph with
the weights already in its kernels' layout for this CPU, checked to give the same logits. `generate`
and `bench` then map those weights from the file instead of copying them onto the heap, which keeps
the growth of the process's Anonymous memory (which the kernel cannot reclaim) small: {growth}
(`bench` shows what the tokenizer, ~100 MB, and the import of onnx and onnxruntime, 4–11 MB, hold on
lines of their own). Peak resident memory rises by {peak_rise} of clean file pages, which the kernel can
reclaim under pressure. Skip it if the disk is
short; everything works without it (the weights are then moved onto transparent huge pages after
loading, when the board's kernel is Linux 6.1 or newer; `bench` prints how many MB)."""

#: the bundle README's memory figures per quantized dtype: Anonymous growth with the pre-packed copy
#: and from the heap, and how much the copy raises the peak (`bench --board sl2610 --prompt-tokens 512
#: --new-tokens 128` on x86-64, the default exports of the real 270M)
QUANTIZED_MEMORY_FIGURES = {
    "int8": {"growth": "about 0.01 × the model after a short prompt and 0.09 × after a 512-token one and 128 steps "
                       "with the KV cache in use, against 1.07 × and 1.148 × without it (the default int8 export on "
                       "x86-64, 2026-12-07)",
             "peak_rise": "90–190 MB"},
    "int4": {"growth": "0.15 × the model after a 512-token prompt and 128 steps with the KV cache in use, against "
                       "1.34 × without it (the default int4 export on x86-64, 2026-12-07; peak 650 MB with it, "
                       "578 MB without)",
             "peak_rise": "about 70 MB"},
}

#: the 270M bf16 export's peak in `bench --board sl2610` on x86-64 (2026-12-04 and 2026-12-05, two
#: machines), GB: quoted by the bundle README and by `bundle`'s note for float weights
BF16_PEAK_GB = (1.92, 2.02)

#: the bundle README's memory paragraph for fp32 / bf16 weights
FLOAT_MEMORY = """The weights are {dtype}: onnxruntime computes with them in float32, about 1.1 GB for the 270M model,
so this folder has no `prepack` step (a pre-packed copy of float weights is 2–4 × the model on disk
and raises the peak further). On x86-64 a bf16 export's `bench --board sl2610` peaked at {peak[0]}–{peak[1]} GB
(2026-12-04 and 2026-12-05, two machines), over the 1.9 GB budget: the int8 or int4 export is the one for the board; use this
one to compare."""


def _check_wheel(wheel: Path, spec: Board) -> None:
    """A wheel is a zip archive; this one must hold the toolkit (``gemma_export/__init__.py``), every
    member must decompress to its recorded CRC, its ``*.dist-info/METADATA`` must name the version
    in the file name (``gemma_export-VERSION-...whl``), which the bundle's README installs, and that
    version must be this toolkit's (``BUNDLE.json`` records it as the version that wrote the
    bundle, and this version checked the export); the file name's tags must be ones the board's pip
    installs (:meth:`~gemma_export.boards.Board.wheel_tag_problem`).

    Raises:
        FormatError: not a zip archive, one without the package or its metadata, a damaged member,
            a version that differs from the file name's or from this toolkit's, or tags the board
            cannot install.
    """
    problem = spec.wheel_tag_problem(wheel.name)  # from the name alone: before the archive is read
    if problem is not None:
        raise FormatError(f"{wheel}: {problem}; build the wheel with `pip wheel --no-deps` from this toolkit's "
                          "sources, or leave out --wheel and bundle builds it")
    import zipfile

    try:
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
            damaged = archive.testzip()  # reads every member: a wheel pip would refuse on the board
            metadata = next((n for n in names if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
            text = archive.read(metadata).decode("utf-8", "replace") if metadata else ""
            other_code = None if damaged else _differing_source(archive, names)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:  # zlib.error is not an OSError
        raise FormatError(f"{wheel}: not a readable wheel (a zip archive): {exc}") from None
    except Exception as exc:  # zlib.error from a member that does not decompress
        raise FormatError(f"{wheel}: a damaged wheel: {type(exc).__name__}: {exc}") from None
    if damaged is not None:
        raise FormatError(f"{wheel}: a damaged wheel: member {damaged} does not match its recorded CRC")
    if "gemma_export/__init__.py" not in names:
        raise FormatError(f"{wheel}: a zip archive without gemma_export/__init__.py; not a gemma_export wheel")
    if metadata is None:
        raise FormatError(f"{wheel}: no *.dist-info/METADATA; not a wheel pip can install")
    version = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Version:")), None)
    named = wheel.name.split("-")[1] if wheel.name.count("-") >= 2 else None
    if version != named:
        raise FormatError(f"{wheel}: its METADATA says version {version!r}, its file name {named!r}; pip refuses "
                          "such a wheel")
    if other_code is not None:  # the version has not moved while the code did: a stale wheel passed the check above
        raise FormatError(f"{wheel}: {other_code}, so the board would run other code than this toolkit, which checked "
                          "the export; build the wheel from these sources (or leave out --wheel and bundle builds it)")
    if version != __version__:  # the board would run other code than what checked the export
        raise FormatError(f"{wheel}: gemma_export version {version}, but this toolkit, which checks the export and "
                          f"writes {BUNDLE_MANIFEST}, is {__version__}; pass a wheel of {__version__}, or leave out "
                          "--wheel and bundle builds it")


def _differing_source(archive, names: set[str]) -> str | None:
    """How the Python sources of the packages in the wheel ``archive`` (an open ``zipfile.ZipFile``
    with members ``names``) differ from those of this running toolkit (``gemma_export``, ``quant``):
    the first member whose bytes differ, or module missing on either side; None when they are the
    same. An earlier checkout's wheel carries the same version number (0.1.0 for months)."""
    import gemma_export
    import quant

    differences = []
    for package in (gemma_export, quant):
        root = Path(package.__file__).parent
        local = {f"{root.name}/{p.relative_to(root).as_posix()}": p for p in root.rglob("*.py")
                 if "__pycache__" not in p.parts}
        packed = {n for n in names if n.startswith(f"{root.name}/") and n.endswith(".py")}
        for name in sorted(local.keys() | packed):
            if name not in packed:
                differences.append(f"it lacks {name}")
            elif name not in local:
                differences.append(f"its {name} is no module of this toolkit")
            elif archive.read(name) != local[name].read_bytes():
                differences.append(f"its {name} differs from this toolkit's {local[name]}")
    if not differences:
        return None
    more = len(differences) - 1
    return differences[0] + (f" (and {more} other module{'' if more == 1 else 's'})" if more else "")


def write_bundle(model_dir: str | Path, out_dir: str | Path, board: str = DEFAULT_BOARD, wheel: str | Path | None = None,
           progress: Callable[[str], None] | None = None) -> BundleResult:
    """Write the board folder for ``model_dir`` (an export) to ``out_dir``.

    Args:
        model_dir: an export folder with its ``manifest.json`` (verified first).
        out_dir: the bundle folder; must not exist or be empty or a previous bundle (unchanged, or
            with the pre-packed copy ``gemma-export prepack`` made in its ``model/``).
        board: a key of ``boards.BOARDS``.
        wheel: a prebuilt gemma_export wheel; default: built from the source tree with pip.
        progress: called with a line as each step starts (copying, building the wheel) and for each
            folder a killed earlier bundle left beside ``out_dir`` that is removed.

    Returns:
        A :class:`BundleResult`: ``out_dir`` and every file written, its path relative to
        ``out_dir`` → bytes (``total_bytes`` sums them).

    Raises:
        GemmaExportError: unknown board (``ConfigError``); the export fails verification (``VerificationError``) or
            has no ``tokenizer.json`` (``FormatError``: the board's commands need it);
            ``out_dir`` is unusable (``OutputError``); the wheel cannot be found or built.
    """
    check_arguments("write_bundle", model_dir=(model_dir, "path"), out_dir=(out_dir, "path"), board=(board, "str"),
                    wheel=(wheel, "path?"), progress=(progress, "callable?"))
    from .verify import verify_manifest
    from .onnx_files import MANIFEST_FILE
    from .prepack import PREPACKED_DIR, derived_copy
    from .manifest import read_manifest
    from .staging import check_free_space, check_replaceable, file_sha256, staged_folder
    from .text_files import require_file

    spec = find_board(board)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    files = verify_manifest(model_dir)
    if "tokenizer.json" not in files:  # the README's generate and bench lines need it
        raise FormatError(f"{model_dir}: no tokenizer.json, so the board could not run the bundle's README "
                          "(generate, bench); export it again with --tokenizer TOKENIZER.json (the model's own; a "
                          "reference .mlir carries none), or from a GGUF or a transformers folder that has one")
    model_manifest = read_manifest(model_dir)  # verified above
    out = out_dir.resolve()
    if out == model_dir.resolve():
        raise OutputError(f"{out_dir}: is the model folder itself; the bundle needs a folder of its own (it copies "
                          "the model into its model/)")
    if model_dir.resolve() in out.parents:
        raise OutputError(f"{out_dir}: the bundle folder may not be inside the model folder {model_dir}")
    if out in model_dir.resolve().parents:
        raise OutputError(f"{out_dir}: the model folder {model_dir} lies inside it, and the bundle would replace it")
    # the pre-packed copy the bundle's README has the board make
    check_replaceable(out_dir, "bundle", BUNDLE_MANIFEST,
                      derived=lambda out: derived_copy(out, f"{BUNDLE_MODEL_DIR}/{PREPACKED_DIR}"))
    if wheel is not None:
        wheel = require_file(wheel, "wheel (--wheel)")
        if not wheel.name.startswith("gemma_export-") or wheel.suffix != ".whl":
            raise SourceNotFoundError(f"{wheel}: expected a gemma_export-*.whl file, found the name '{wheel.name}'")
        _check_wheel(wheel, spec)
    # the model's files, its manifest, the wheel (one built here is ~0.2 MB) and the README and listing
    wheel_bytes = wheel.stat().st_size if wheel is not None else WHEEL_BYTES_ESTIMATE
    check_free_space(out, sum(files.values()) + (model_dir / MANIFEST_FILE).stat().st_size + wheel_bytes + 10**5,
                     "bundle")
    say = progress or (lambda _msg: None)
    if model_manifest.get("dtype") not in QUANTIZED_DTYPES:  # said here too, not only in the bundle's README
        say(f"note: the weights are {model_manifest.get('dtype')}: onnxruntime holds them as float32 (4 bytes a "
            f"weight; the 270M's bf16 export peaked at {BF16_PEAK_GB[0]} to {BF16_PEAK_GB[1]} GB, over the {board}'s "
            f"{spec.memory_bytes / 1e9:.1f} GB); the int8 or int4 export is the one for the board")
    if (out_dir / BUNDLE_MANIFEST).is_file():  # what is replaced is said, as an export says it
        try:
            old = read_manifest(out_dir / BUNDLE_MODEL_DIR)
        except FormatError:
            old = {}
        described = export_description(old)
        what = f" of {'an' if old.get('dtype') in QUANTIZED_DTYPES else 'a'} {described}" if described else ""
        say(f"{out_dir} holds an earlier bundle{what}; it is replaced once this one is written and checked")
    old_copy = out_dir / BUNDLE_MODEL_DIR / PREPACKED_DIR
    if old_copy.is_dir():  # made on the board from the files being replaced: it cannot serve the new ones
        copy_bytes = sum(p.stat().st_size for p in old_copy.rglob("*") if p.is_file())
        say(f"the previous bundle's pre-packed copy {old_copy} ({copy_bytes / 1e6:,.1f} MB) is deleted with it (it "
            "was made from the files being replaced); run `gemma-export prepack --model model` on the board again")
    with staged_folder(out, "bundle", notify=say) as staging:
        say(f"copying {len(files) + 1} model files ({sum(files.values()) / 1e6:,.1f} MB) ...")  # + the manifest
        (staging / BUNDLE_MODEL_DIR).mkdir()
        for name in [*files, MANIFEST_FILE]:
            shutil.copyfile(model_dir / name, staging / BUNDLE_MODEL_DIR / name)
        if wheel is None:
            say("building the gemma_export wheel (pip wheel) ...")
            # inside the staging folder: what a killed bundle leaves there goes with it (remove_stale)
            build = staging / ".wheel-build"
            build.mkdir()
            built = build_wheel(build, scratch_dir=build)
            shutil.copyfile(built, staging / built.name)
            wheel_name = built.name
            shutil.rmtree(build)
        else:
            shutil.copyfile(wheel, staging / wheel.name)
            wheel_name = wheel.name
        (staging / "README.md").write_text(_readme(board, spec, wheel_name, model_manifest))
        listing = {str(p.relative_to(staging)): p for p in sorted(staging.rglob("*")) if p.is_file()}
        say("checking the copies against the model's manifest ...")
        verify_manifest(staging / BUNDLE_MODEL_DIR)  # the copies, not only the originals
        manifest = {"board": board, "gemma_export_version": __version__,
                    "files": {rel: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for rel, p in listing.items()}}
        (staging / BUNDLE_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        sizes = {rel: entry["bytes"] for rel, entry in manifest["files"].items()}
        sizes[BUNDLE_MANIFEST] = (staging / BUNDLE_MANIFEST).stat().st_size
    return BundleResult(out_dir, sizes)


def verify_bundle(folder: str | Path) -> dict[str, int]:
    """Re-check a board folder against its ``BUNDLE.json``: every listed file present with its size
    and sha256 and nothing unlisted, except the pre-packed copy ``gemma-export prepack`` adds to
    ``model/`` on the board (checked against its own ``prepacked.json`` when loaded); then the
    model folder as an export (:func:`gemma_export.verify.verify_manifest`).

    Returns:
        path relative to ``folder`` → size in bytes of the verified files (``BUNDLE.json`` not counted).

    Raises:
        SourceNotFoundError: not a board folder (no ``BUNDLE.json``).
        VerificationError: naming the first file that differs and how (a deleted ``model/`` as its
            first missing file); an unreadable or malformed ``BUNDLE.json``; then whatever
            :func:`~gemma_export.verify.verify_manifest` raises for ``model/``.
        ConfigError: ``folder`` is no path (:func:`~gemma_export.errors.check_arguments`).
    """
    check_arguments("verify_bundle", folder=(folder, "path"))
    from .errors import VerificationError
    from .verify import verify_manifest
    from .prepack import LEFTOVER_PREFIXES, PREPACKED_DIR
    from .staging import check_listed_file, listed_files

    folder = Path(folder)
    listing_path = folder / BUNDLE_MANIFEST
    if (what := non_regular(listing_path)) is not None:  # a folder or FIFO where the listing belongs
        raise VerificationError(f"{listing_path}: is {what}; a board folder's listing is a JSON file")
    if not listing_path.is_file():  # model/ may be gone: its files are then named as missing
        raise SourceNotFoundError(f"{folder}: not a board folder of gemma-export bundle ({BUNDLE_MANIFEST} and "
                                  "model/manifest.json expected)")
    if listing_path.is_symlink():
        raise VerificationError(f"{listing_path}: is a link; a board folder's listing is a file of its own")
    try:
        listing = json.loads(read_bounded(listing_path, "a board folder's listing").decode("utf-8"))
    except FormatError as exc:  # larger than any listing
        raise VerificationError(str(exc)) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise VerificationError(f"{listing_path}: unreadable: {exc}") from None
    except OSError as exc:  # permissions, an I/O error
        raise VerificationError(f"{listing_path}: cannot be read ({exc.strerror or exc})") from None
    if not isinstance(listing, dict):
        raise VerificationError(f"{listing_path}: expected a JSON object, found {shown(listing)}")
    expected = listed_files(listing.get("files"), listing_path, nested=True)
    for name, (size, digest) in expected.items():
        check_listed_file(folder / name, size, digest, BUNDLE_MANIFEST, "a board folder")

    def derived(rel: Path) -> bool:  # what prepack adds to model/ on the board (verify_manifest checks it)
        return len(rel.parts) >= 2 and rel.parts[0] == BUNDLE_MODEL_DIR and (
            rel.parts[1] == PREPACKED_DIR or rel.parts[1].startswith(LEFTOVER_PREFIXES))

    # a link to a folder is listed too (rglob does not enter it, and is_dir() follows it)
    extra = sorted(rel.as_posix() for rel in (p.relative_to(folder) for p in folder.rglob("*")
                                              if p.is_symlink() or not p.is_dir())
                   if rel.as_posix() not in expected and rel.as_posix() != BUNDLE_MANIFEST and not derived(rel))
    if extra:
        raise VerificationError(f"{folder}: files not in {BUNDLE_MANIFEST}: {', '.join(extra[:5])}"
                                f"{f' and {len(extra) - 5} more' if len(extra) > 5 else ''}")
    for field, what in (("board", "the board's name"), ("gemma_export_version", "the version that wrote it")):
        if not isinstance(listing.get(field), str) or not listing[field]:
            found = f"found {shown(listing[field])}" if field in listing else "missing"
            raise VerificationError(f"{listing_path}: field '{field}' must be {what} (a string), {found}")
    if listing["board"] not in BOARDS:  # bundle writes only boards it knows, and its README is for that board
        raise VerificationError(f"{listing_path}: field 'board' is {shown(listing['board'])}, expected one of "
                                f"{', '.join(BOARDS)}")
    # the README installs the wheel beside it: its version is the one that wrote the bundle
    wheels = sorted(name for name in expected if "/" not in name and name.startswith("gemma_export-")
                    and name.endswith(".whl"))
    versions = {name.split("-")[1] for name in wheels if name.count("-") >= 2}
    if versions and versions != {listing["gemma_export_version"]}:
        raise VerificationError(f"{listing_path}: field 'gemma_export_version' is "
                                f"{shown(listing['gemma_export_version'])}, but the folder's wheel "
                                f"{', '.join(wheels)} is version {', '.join(sorted(versions))}")
    verify_manifest(folder / BUNDLE_MODEL_DIR)
    return {name: size for name, (size, _) in expected.items()}
