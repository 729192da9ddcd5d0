"""``gemma-export bundle``: the board folder holds exactly the verified model, the wheel, a README
and BUNDLE.json; bad input leaves nothing behind."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import re
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gemma_export.cli import app
from gemma_export.errors import GemmaExportError

runner = CliRunner()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    from gemma_export.bundle import build_wheel

    # built in a scratch folder whose name pip would misread in a plain path (';' starts a marker),
    # as a bundle's staging folder is named after --out
    odd = tmp_path_factory.mktemp("wheel") / "board;v2 copy"
    odd.mkdir()
    return build_wheel(odd.parent, scratch_dir=odd)


def test_wheel_carries_both_packages_and_the_console_script(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "gemma_export/cli.py" in names and "quant/int8.py" in names
    assert "gemma_export/sources/gguf.py" in names and not [n for n in names if "__pycache__" in n]
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "gemma-export = gemma_export.console:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_bundle_layout_and_checksums(tiny_int8_export, wheel, tmp_path):
    out = tmp_path / "board"
    result = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out), "--wheel", str(wheel)])
    assert result.exit_code == 0, result.output
    model_files = sorted(p.name for p in tiny_int8_export.iterdir())
    found = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert found == sorted(["README.md", "BUNDLE.json", wheel.name, *[f"model/{n}" for n in model_files]])
    listed = json.loads((out / "BUNDLE.json").read_text())["files"]
    assert sorted(listed) == sorted(f for f in found if f != "BUNDLE.json")
    for rel, entry in listed.items():
        data = (out / rel).read_bytes()
        assert entry["bytes"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
    # the size in the export's unit, so it compares with the export's (it said MiB beside the export's MB)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert f"wrote {out} ({total / 1e6:,.1f} MB); on the board" in result.stdout
    readme = (out / "README.md").read_text()
    # the toolkit itself reinstalled first: an earlier bundle's wheel of the same version number was kept
    # by pip (a break-it run), and the board ran the old code
    assert (f"python3 -m venv ~/gx && ~/gx/bin/pip install --force-reinstall --no-deps ./{wheel.name} && "
            f"~/gx/bin/pip install ./{wheel.name}") in readme
    assert "Python 3.12" in readme and "glibc 2.28 or newer" in readme
    # the offline route, each command whole on one line of a fenced block (to copy), never indented:
    # tools/aarch64/try_bundle.sh runs every indented line on a board whose Python (3.13 under
    # emulation) the 3.12 wheels do not fit
    lines = readme.splitlines()
    assert (f"pip download --only-binary=:all: --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 "
            f"--python-version 3.12 --implementation cp -d ../gx-wheels ./{wheel.name}") in lines  # not inside: verify
    offline_install = (f"python3 -m venv ~/gx && ~/gx/bin/pip install --force-reinstall --no-deps ./{wheel.name} && "
                       f"~/gx/bin/pip install --no-index --find-links ~/wheels ./{wheel.name}")
    assert offline_install in lines and lines[lines.index(offline_install) - 1] == "```sh"
    assert not [line for line in lines if line.startswith("    ") and "wheels" in line]
    assert "gemma-export generate --model model --threads 2" in readme
    assert "gemma-export bench --model model --board sl2610" in readme
    assert readme.index("gemma-export prepack --model model") < readme.index("gemma-export generate --model model")
    # what generate prints depends on the model: the board team is told what to expect (helper-found)
    assert "A pre-trained model, such as the Gemma 3 270M bundled with the toolkit, continues the prompt" in " ".join(lines)
    assert "about 0.01 × the model after a short prompt and 0.09 × after a 512-token one" in " ".join(lines)
    assert runner.invoke(app, ["verify", str(out / "model")]).exit_code == 0
    assert "~/gx/bin/gemma-export verify .\n" in readme  # the whole folder: BUNDLE.json, then the model
    checked = runner.invoke(app, ["verify", str(out)])
    assert checked.exit_code == 0, checked.output
    assert checked.stdout.startswith(f"ok: {out} matches BUNDLE.json ({len(listed)} files, "
                                     f"{sum(e['bytes'] for e in listed.values()):,} bytes); its model folder")
    # the bundle itself, to any other command that takes an export: says where its export is (generate
    # told the user to export into the bundle, bench that the tokenizer was missing)
    for command in (["generate", "--model", str(out), "--prompt", "a"],
                    ["bench", "--model", str(out)], ["quality", "--model", str(out)], ["prepack", "--model", str(out)],
                    ["parity", "--model", str(out), "--golden", str(out / "README.md")]):
        pointed = runner.invoke(app, command)
        assert pointed.exit_code == 2, (command, pointed.output)
        assert pointed.stderr.strip() == f"error: {out}: a bundle folder; its export is {out / 'model'} (give that)", command
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left
    # BUNDLE.json alone makes it a bundle, for every command as for verify: with its model's manifest
    # gone, generate said "no exported model here" (it looked for model.onnx at the top)
    (out / "model" / "manifest.json").unlink()
    pointed = runner.invoke(app, ["generate", "--model", str(out), "--prompt", "a"])
    assert pointed.stderr.strip() == f"error: {out}: a bundle folder; its export is {out / 'model'} (give that)"
    checked = runner.invoke(app, ["verify", str(out)])
    assert checked.exit_code == 2 and "model/manifest.json: listed in BUNDLE.json but missing" in checked.stderr


def test_tampered_export_is_refused_and_nothing_written(tiny_int8_export, wheel, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    data = bytearray((model / "model.onnx.data").read_bytes())
    data[100] ^= 0xFF
    (model / "model.onnx.data").write_bytes(bytes(data))
    out = tmp_path / "board"
    result = runner.invoke(app, ["bundle", "--model", str(model), "--out", str(out), "--wheel", str(wheel)])
    assert result.exit_code == 2
    assert "model.onnx.data: sha256 differs from the manifest" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize("args, message", [
    (["--board", "pi5"], "--board: unknown board 'pi5'; known: sl2610"),
    (["--wheel", "nothing.whl"], "nothing.whl: no such wheel (--wheel)"),
    (["--wheel", "{tmp}"], "is a folder; expected a wheel (--wheel)"),
])
def test_bad_arguments(tiny_int8_export, tmp_path, args, message):
    out = tmp_path / "board"
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out), *args])
    assert result.exit_code == 2 and message in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists()


def test_a_bundle_over_the_folder_its_model_lies_in_is_refused(tiny_int8_export, wheel, tmp_path):
    # re-bundling a board folder's own model/ into that board folder would replace the model's folder
    board = tmp_path / "board"
    assert runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(board),
                               "--wheel", str(wheel)]).exit_code == 0
    before = sorted(str(p.relative_to(board)) for p in board.rglob("*"))
    result = runner.invoke(app, ["bundle", "--model", str(board / "model"), "--out", str(board), "--wheel", str(wheel)])
    assert result.exit_code == 2 and "lies inside it, and the bundle would replace it" in result.output
    assert sorted(str(p.relative_to(board)) for p in board.rglob("*")) == before


@pytest.mark.parametrize("out, message", [
    (".", "is the model folder itself; the bundle needs a folder of its own (it copies the model into its model/)"),
    ("board", "the bundle folder may not be inside the model folder"),
])
def test_a_bundle_into_its_own_model_folder_is_refused(tiny_int8_export, wheel, tmp_path, out, message):
    """A board engineer's `bundle --model ../int8 --out ../int8` was told the bundle folder was inside
    the model folder."""
    model = tmp_path / "int8"
    shutil.copytree(tiny_int8_export, model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    result = runner.invoke(app, ["bundle", "--model", str(model), "--out", str(model / out), "--wheel", str(wheel)])
    assert result.exit_code == 2 and result.output.strip().splitlines() == [f"error: {model / out}: {message}"
                                                                            + ("" if out == "." else f" {model}")]
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def test_an_export_without_a_tokenizer_is_refused_before_any_work(tiny_dir, wheel, tmp_path):
    # the README's generate and bench lines need model/tokenizer.json
    from gemma_export.exporter import export

    model = export(tiny_dir, tmp_path / "model", "fp32").out_dir  # a transformers folder without tokenizer
    assert not (model / "tokenizer.json").exists()
    out = tmp_path / "board"
    result = runner.invoke(app, ["bundle", "--model", str(model), "--out", str(out), "--wheel", str(wheel)])
    assert result.exit_code == 2 and "no tokenizer.json, so the board could not run the bundle's README" in result.output
    assert "export it again with --tokenizer TOKENIZER.json" in result.output  # the fix: it said "not a reference .mlir"
    assert not out.exists()


@pytest.mark.parametrize("platforms", [(), ("macosx_11_0_arm64",)])
def test_a_board_without_a_manylinux_tag_gets_a_plain_wheel_line(platforms):
    from gemma_export import boards

    spec = boards.Board(title="Other board", threads=1, memory_bytes=10**9, headroom_bytes=10**8, python="3.12",
                        platforms=platforms)
    assert spec.wheel_requirements == "wheels for the board's platform"



def _renamed_wheel(wheel: Path, fake: Path) -> None:
    """The real wheel's members under another file name (its METADATA keeps the real version)."""
    fake.write_bytes(wheel.read_bytes())


def _package_only(wheel: Path, fake: Path) -> None:
    with zipfile.ZipFile(fake, "w") as archive:
        archive.writestr("gemma_export/__init__.py", "")


def _damaged_member(wheel: Path, fake: Path) -> None:
    """The real wheel with bytes of a compressed member's data flipped (the CRC no longer matches)."""
    with zipfile.ZipFile(wheel) as archive:
        info = archive.getinfo("gemma_export/cli.py")
    raw = bytearray(wheel.read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + 200
    raw[start:start + 16] = bytes(16)
    fake.write_bytes(bytes(raw))



def _stored_member_changed(wheel: Path, fake: Path) -> None:
    """The real wheel's members stored uncompressed, one byte of a member's data changed: it reads
    back without error, only its CRC tells."""
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(fake, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    with zipfile.ZipFile(fake) as archive:
        info = archive.getinfo("gemma_export/cli.py")
    raw = bytearray(fake.read_bytes())
    raw[info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + 100] ^= 0x01
    fake.write_bytes(bytes(raw))

@pytest.mark.parametrize("content, message", [
    (b"not a zip", "not a readable wheel (a zip archive)"),
    (None, "a zip archive without gemma_export/__init__.py; not a gemma_export wheel"),
    (_package_only, "no *.dist-info/METADATA; not a wheel pip can install"),
    (_damaged_member, "a damaged wheel"),
    (_stored_member_changed, "a damaged wheel: member gemma_export/cli.py does not match its recorded CRC"),
])
def test_a_wheel_that_is_not_the_toolkit_is_refused(tiny_int8_export, wheel, tmp_path, content, message):
    """Only the name was checked: a 9-byte text file called gemma_export-0.1.0-py3-none-any.whl was bundled;
    then only the member names: a wheel whose members do not decompress, or without metadata, was bundled."""
    fake = tmp_path / "gemma_export-0.1.0-py3-none-any.whl"
    if callable(content):
        content(wheel, fake)
    elif content is None:
        with zipfile.ZipFile(fake, "w") as archive:
            archive.writestr("other/__init__.py", "")
    else:
        fake.write_bytes(content)
    out = tmp_path / "board"
    result = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out), "--wheel", str(fake)])
    assert result.exit_code == 2 and f"{fake}: {message}" in result.output, result.output
    assert not out.exists()


def test_a_wheel_whose_name_and_metadata_disagree_is_refused(tiny_int8_export, wheel, tmp_path):
    fake = tmp_path / "gemma_export-9.9.9-py3-none-any.whl"
    _renamed_wheel(wheel, fake)
    out = tmp_path / "board"
    result = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out), "--wheel", str(fake)])
    version = wheel.name.split("-")[1]
    assert result.exit_code == 2, result.output
    assert f"{fake}: its METADATA says version '{version}', its file name '9.9.9'; pip refuses such a wheel" in result.output
    assert not out.exists()


@pytest.mark.parametrize("tags, message", [
    ("py3-none-win_amd64", "its platform tag 'win_amd64' is not one the board installs (any, manylinux_2_28_aarch64, "
                           "manylinux2014_aarch64, or another aarch64 manylinux tag of glibc 2.17 to 2.28)"),
    ("cp312-cp312-manylinux_2_31_aarch64", "its platform tag 'manylinux_2_31_aarch64' is not one the board installs"),
    ("cp312-cp312-manylinux_2_28_x86_64", "its platform tag 'manylinux_2_28_x86_64' is not one the board installs"),
    ("cp311-cp311-manylinux_2_28_aarch64", "its ABI tag 'cp311' is not one the board's CPython 3.12 installs "
                                           "(none, abi3, cp312)"),
    ("py313-none-manylinux_2_28_aarch64", "its Python tag 'py313' is not one the board's CPython 3.12 installs "
                                          "(py3, py3N or cp312; cp3N up to it with abi3)"),
    ("cp312-cp312-any", "its tags 'cp312-cp312-any' pair no Python, ABI and platform the board's CPython 3.12 installs "
                        "together"),
    ("py3-none-manylinux_2_5_aarch64", "its platform tag 'manylinux_2_5_aarch64' is not one the board installs"),
    ("cp313-abi3-manylinux_2_28_aarch64", "its Python tag 'cp313' is not one the board's CPython 3.12 installs"),
    ("py313-none-any", "its Python tag 'py313' is not one the board's CPython 3.12 installs"),
    ("py3-cp311-any", "its ABI tag 'cp311' is not one the board's CPython 3.12 installs (none, abi3, cp312)"),
])
def test_a_wheel_the_board_cannot_install_is_refused(tiny_int8_export, wheel, tmp_path, tags, message):
    """A wheel for another platform or Python was bundled; pip refused it on the board."""
    version = wheel.name.split("-")[1]
    fake = tmp_path / f"gemma_export-{version}-{tags}.whl"
    _renamed_wheel(wheel, fake)
    out = tmp_path / "board"
    result = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out), "--wheel", str(fake)])
    assert result.exit_code == 2 and f"{fake}: {message}" in result.output, result.output
    assert not out.exists()


@pytest.mark.parametrize("tags", ["py2.py3-none-any", "cp312-abi3-manylinux_2_17_aarch64.manylinux2014_aarch64",
                                  "py311-none-linux_aarch64", "cp310-abi3-manylinux_2_28_aarch64"])
def test_a_wheel_tagged_for_the_board_is_bundled(tiny_int8_export, wheel, tmp_path, tags):
    version = wheel.name.split("-")[1]
    fake = tmp_path / f"gemma_export-{version}-{tags}.whl"
    _renamed_wheel(wheel, fake)
    out = tmp_path / "board"
    result = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out), "--wheel", str(fake)])
    assert result.exit_code == 0, result.output
    assert (out / fake.name).read_bytes() == wheel.read_bytes()


def test_the_boards_wheel_tags_are_the_ones_pip_takes():
    """A tester compared the check with packaging.tags (pip's own list): it took py3-abi3-any,
    cp312-cp312-any and manylinux_2_5 for aarch64, and refused cp311-abi3, which pip installs."""
    tags = pytest.importorskip("packaging.tags")
    utils = pytest.importorskip("packaging.utils")
    from gemma_export.boards import BOARDS

    board = BOARDS["sl2610"]
    platforms = [f"manylinux_2_{m}_aarch64" for m in range(28, 16, -1)] + ["manylinux2014_aarch64", "linux_aarch64"]
    supported = set(tags.cpython_tags(python_version=(3, 12), platforms=platforms)) | set(
        tags.compatible_tags(python_version=(3, 12), interpreter="cp312", platforms=platforms))
    pythons = ["py3", "py311", "py312", "py313", "cp310", "cp312", "cp313", "py2.py3"]
    abis = ["none", "abi3", "cp312", "cp311"]
    platforms_tried = ["any", "linux_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64", "manylinux_2_31_aarch64",
                       "manylinux_2_5_aarch64", "manylinux2014_aarch64", "manylinux_2_28_x86_64", "win_amd64"]
    checked = 0
    for python in pythons:
        for abi in abis:
            for platform in platforms_tried:
                name = f"gemma_export-0.1.0-{python}-{abi}-{platform}.whl"
                pip_takes = bool(utils.parse_wheel_filename(name)[3] & supported)
                assert (board.wheel_tag_problem(name) is None) == pip_takes, name
                checked += 1
    assert checked == 288


def test_a_wheel_of_another_version_is_refused(tiny_int8_export, wheel, tmp_path):
    """BUNDLE.json records the version that wrote it; a wheel of another version ran other code on the board."""
    version = wheel.name.split("-")[1]
    fake = tmp_path / "gemma_export-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(fake, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith(".dist-info/METADATA"):
                data = data.replace(f"Version: {version}".encode(), b"Version: 9.9.9")
            target.writestr(info.filename, data)
    out = tmp_path / "board"
    result = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out), "--wheel", str(fake)])
    assert result.exit_code == 2, result.output
    assert (f"{fake}: gemma_export version 9.9.9, but this toolkit, which checks the export and writes BUNDLE.json, "
            f"is {version}") in result.output
    assert not out.exists()


@pytest.mark.parametrize("change, message", [
    (lambda name, data: data + b"\n# an earlier checkout\n" if name == "gemma_export/cli.py" else data,
     "its gemma_export/cli.py differs from this toolkit's "),
    (lambda name, data: None if name == "quant/int4.py" else data, "it lacks quant/int4.py"),
])
def test_a_wheel_of_other_sources_under_the_same_version_is_refused(tiny_int8_export, wheel, tmp_path, change, message):
    """A tester: a wheel built from a checkout four days old (version 0.1.0, as every commit's) was
    bundled and verified; the board would have run that code."""
    fake = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(fake, "w") as target:
        for info in source.infolist():
            data = change(info.filename, source.read(info))
            if data is not None:
                target.writestr(info.filename, data)
    out = tmp_path / "board"
    result = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out), "--wheel", str(fake)])
    assert result.exit_code == 2, result.output
    assert f"{fake}: {message}" in result.output and "so the board would run other code than this toolkit" in result.output
    assert not out.exists()


def test_foreign_nonempty_folder_is_not_replaced(tiny_int8_export, wheel, tmp_path):
    out = tmp_path / "board"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out), "--wheel", str(wheel)])
    assert result.exit_code == 2 and "is not an unchanged bundle of gemma-export (a BUNDLE.json of ours" in result.output
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_an_out_below_a_file_is_refused_before_any_work(tiny_int8_export, wheel, tmp_path):
    """The bundle's destination gets the export's checks (check_replaceable): a file among the
    parents is named, with the bundle folder, before the model is copied."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    result = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(blocker / "board"),
                                 "--wheel", str(wheel)])
    assert result.exit_code == 2, result.output
    assert f"{blocker / 'board'}: cannot create the bundle folder: {blocker} is a file, not a folder" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and blocker.read_text() == "mine"


def test_a_prepacked_copy_stays_out_of_the_bundle(tiny_int8_export, wheel, tmp_path):
    from gemma_export.prepack import prepack

    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    prepack(model)  # machine-specific: the board makes its own
    out = tmp_path / "board"
    result = runner.invoke(app, ["bundle", "--model", str(model), "--out", str(out), "--wheel", str(wheel)])
    assert result.exit_code == 0, result.output
    assert not (out / "model" / "prepacked").exists()
    assert sorted(p.name for p in (out / "model").iterdir()) == sorted(p.name for p in tiny_int8_export.iterdir())


def test_building_the_wheel_leaves_the_checkout_as_it_was(tmp_path):
    """setuptools writes build/ and *.egg-info beside the sources it builds: the bundle builds from a
    temporary copy, so the user's checkout gets neither."""
    from gemma_export.bundle import _project_root, build_wheel

    root = _project_root()
    before = sorted(p.name for p in root.iterdir())
    assert build_wheel(tmp_path).name.startswith("gemma_export-")
    assert sorted(p.name for p in root.iterdir()) == before


def test_the_bundle_readme_carries_the_board_figures_bench_applies():
    """The bundle README's threads, memory headroom, Python and wheel platform are the board's, from
    the one table that `bench --board` and both commands' help read too."""
    from gemma_export import bench, boards, bundle

    assert bench.BOARDS is boards.BOARDS and set(boards.BOARDS) == {"sl2610"} == {boards.DEFAULT_BOARD}
    # the SL2610's own figures (issue #8 and the board team's notes): 2 cores, 1.9 GB, 300 MB kept free, Python 3.12
    spec = boards.board("sl2610")
    assert (spec.threads, spec.memory_bytes, spec.headroom_bytes, spec.python) == (2, 1_900_000_000, 300_000_000, "3.12")
    text = bundle._readme("sl2610", spec, "gemma_export.whl", {"config": {}, "dtype": "int8"})
    assert "--threads 2 " in text and "less than 300 MB" in text and "--python-version 3.12 " in text
    assert "--platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64" in text
    assert "aarch64 wheels, which need glibc 2.28 or newer" in text
    help_text = " ".join(runner.invoke(app, ["bench", "--help"]).output.split())
    assert "sl2610: 2 threads and a 1.9 GB budget that must keep 300 MB free" in help_text
    assert "(default 2, the sl2610's cores;" in help_text
    assert "Target board (sl2610)" in " ".join(runner.invoke(app, ["bundle", "--help"]).output.split())


def test_another_board_gets_its_own_figures_in_the_bundle_readme(monkeypatch):
    """A board added to the table is known to `boards.board` and its README carries its own
    figures (the commands' help is built at import, from the table as shipped)."""
    from gemma_export import boards, bundle

    tiny = boards.Board(title="Tiny board", threads=3, memory_bytes=700_000_000, headroom_bytes=123_000_000,
                        python="3.11", platforms=("manylinux_2_17_armv7l",))
    monkeypatch.setitem(boards.BOARDS, "tiny", tiny)
    assert boards.board("tiny") is tiny
    text = bundle._readme("tiny", tiny, "gemma_export.whl", {"config": {}, "dtype": "int8"})
    assert "for the Tiny board" in text and "--threads 3 " in text and "less than 123 MB" in text
    assert "--python-version 3.11 " in text and "--platform manylinux_2_17_armv7l --python-version" in text
    assert "armv7l wheels, which need glibc 2.17 or newer" in text and "aarch64" not in text
    with pytest.raises(GemmaExportError, match="--board: unknown board 'pi5'; known: sl2610, tiny"):
        boards.board("pi5")


def test_a_bundle_that_will_not_fit_is_refused_before_copying(tiny_int8_export, wheel, tmp_path, monkeypatch):
    import collections

    import gemma_export.staging as staging

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    out = tmp_path / "board"
    result = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out), "--wheel", str(wheel)])
    assert result.exit_code == 2 and re.search(r"board: the bundle needs about 0\.\d MB and .* has 0\.0 MB free", result.output), result.output
    assert not out.exists()


def test_pip_keeps_its_temporary_folders_in_the_wheel_build_scratch_folder(tmp_path, monkeypatch):
    # pip killed mid-build (Ctrl-C on bundle) leaves its pip-build-env-* folders behind in TMPDIR:
    # that TMPDIR must be the build's own scratch folder, which is removed whatever happens
    import subprocess

    from gemma_export import bundle
    from gemma_export.errors import GemmaExportError

    seen = {}

    def interrupted_pip(command, env):
        tmp = env["TMPDIR"]
        (bundle.Path(tmp) / "pip-build-env-x").mkdir()  # what a killed pip leaves
        seen["tmp"] = tmp
        return subprocess.CompletedProcess(command, 1, "", "ERROR: interrupted")

    monkeypatch.setattr(bundle, "_run_in_own_group", interrupted_pip)
    with pytest.raises(GemmaExportError, match="ERROR: interrupted"):
        bundle.build_wheel(tmp_path)
    assert seen["tmp"].startswith(bundle.tempfile.gettempdir()) and "gemma-export-wheel-" in seen["tmp"]
    assert not bundle.Path(seen["tmp"]).exists()


def test_an_interrupted_wheel_build_stops_pip_and_its_children_and_leaves_no_scratch_folder(tmp_path, monkeypatch):
    # a "pip" whose child keeps writing into the scratch folder, as pip's build backend does: an
    # interrupt (Ctrl-C; SIGTERM arrives as an exception too) must stop both before the folder is
    # removed, and reach the caller as itself, not as the removal's "Directory not empty"
    import signal
    import sys
    import time

    from gemma_export import bundle

    pids = tmp_path / "pids"
    script = ("import os, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import os, itertools, pathlib, time\\n"
              "tmp = pathlib.Path(os.environ[\"TMPDIR\"])\\n"
              "for i in itertools.count(): (tmp / f\"f{i}\").write_text(\"x\"); time.sleep(0.001)'])\n"
              f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
              "time.sleep(60)\n")
    monkeypatch.setattr(bundle, "_pip_wheel_command", lambda tree, dest: [sys.executable, "-c", script])
    scratch = []
    real_mkdtemp = bundle.tempfile.mkdtemp
    monkeypatch.setattr(bundle.tempfile, "mkdtemp",
                        lambda *a, **k: scratch.append(real_mkdtemp(*a, **k)) or scratch[-1])

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        with pytest.raises(KeyboardInterrupt):
            bundle.build_wheel(tmp_path / "dest")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert len(scratch) == 1 and not bundle.Path(scratch[0]).exists()
    time.sleep(0.2)  # a straggler would have written again by now
    assert not bundle.Path(scratch[0]).exists()
    for pid in map(int, pids.read_text().split()):  # both gone (or zombies, which write nothing)
        status = bundle.Path(f"/proc/{pid}/status")
        assert not status.exists() or "State:\tZ" in status.read_text()


def _edit_listing(out, **fields):
    """Set fields of a bundle's BUNDLE.json (None: JSON null)."""
    listing = json.loads((out / "BUNDLE.json").read_text())
    listing.update(fields)
    (out / "BUNDLE.json").write_text(json.dumps(listing))


@pytest.mark.parametrize("damage, message", [
    (lambda out: (out / "README.md").write_text("edited\n"), "README.md: 7 bytes, BUNDLE.json says"),
    (lambda out: (out / "README.md").write_bytes((out / "README.md").read_bytes()[:-1] + b"?"),
     "README.md: sha256 differs from BUNDLE.json"),
    (lambda out: next(out.glob("*.whl")).unlink(), ".whl: listed in BUNDLE.json but missing"),
    (lambda out: (out / "notes.txt").write_text("mine"), ": files not in BUNDLE.json: notes.txt"),
    (lambda out: (out / "model" / "extra.bin").write_text("x"), ": files not in BUNDLE.json: model/extra.bin"),
    (lambda out: (out / "BUNDLE.json").write_text('{"files": {"../outside": {"bytes": 1, "sha256": "x"}}}'),
     "lists '../outside', which is not a path inside the folder"),
    (lambda out: (out / "BUNDLE.json").write_text('{"files": {"README.md": {"bytes": -1, "sha256": "x"}}}'),
     "BUNDLE.json: files['README.md'] needs an integer 'bytes' (>= 0) and a string 'sha256', found {"),
    (lambda out: (out / "BUNDLE.json").write_text('{"files": []}'),
     "BUNDLE.json: field 'files' must be an object of file name -> bytes and sha256, found []"),
    (lambda out: (out / "BUNDLE.json").write_text("{oops"), "BUNDLE.json: unreadable"),
    # the record's own fields (probe finding: any value passed)
    (lambda out: _edit_listing(out, board=5), "BUNDLE.json: field 'board' must be the board's name (a string), found 5"),
    (lambda out: _edit_listing(out, board=None), "BUNDLE.json: field 'board' must be the board's name (a string), found null"),
    (lambda out: _edit_listing(out, board="xyz"), "BUNDLE.json: field 'board' is \"xyz\", expected one of sl2610"),
    (lambda out: _edit_listing(out, gemma_export_version=None),
     "BUNDLE.json: field 'gemma_export_version' must be the version that wrote it (a string), found null"),
    (lambda out: _edit_listing(out, gemma_export_version="9.9.9"),
     "BUNDLE.json: field 'gemma_export_version' is \"9.9.9\", but the folder's wheel gemma_export-"),
    (lambda out: (out / "BUNDLE.json").write_text("[]"), "BUNDLE.json: expected a JSON object, found []"),
    # the listing deleted: named, not "manifest.json: missing; not a gemma-export folder"
    (lambda out: (out / "BUNDLE.json").unlink(), "BUNDLE.json: missing, though model/manifest.json is there as in a "
                                                 "board folder of `bundle`; verify the export alone with"),
    (lambda out: shutil.rmtree(out / "model"), "board/model/genai_config.json: listed in BUNDLE.json but missing"),
    (lambda out: (out / "extra_dir").symlink_to(out.parent), ": files not in BUNDLE.json: extra_dir"),
    # what a killed `prepack` on the board leaves in model/ is prepack's to name, not an unlisted file
    (lambda out: ((out / "model" / ".prepacked.staging-x1").mkdir(),
                  (out / "model" / ".prepacked.staging-x1" / "model.onnx.data").write_bytes(b"partial")),
     ".prepacked.staging-x1: left by an earlier gemma-export prepack"),
    (lambda out: (shutil.move(out / "BUNDLE.json", out.parent / "listing.json"),
                  (out / "BUNDLE.json").symlink_to(out.parent / "listing.json")), "BUNDLE.json: is a link"),
])
def test_verify_of_a_bundle_names_what_differs_from_bundle_json(tiny_int8_export, wheel, tmp_path, damage, message):
    out = tmp_path / "board"
    assert runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out),
                               "--wheel", str(wheel)]).exit_code == 0
    damage(out)
    result = runner.invoke(app, ["verify", str(out)])
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_verify_of_a_bundle_accepts_the_copy_prepack_adds_on_the_board(tiny_int8_export, wheel, tmp_path):
    from gemma_export.prepack import prepack

    out = tmp_path / "board"
    assert runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out),
                               "--wheel", str(wheel)]).exit_code == 0
    prepack(out / "model")  # the README's second command
    result = runner.invoke(app, ["verify", str(out)])
    assert result.exit_code == 0, result.output
    assert "pre-packed" in result.stdout  # and the copy itself is checked
    (out / "model" / "prepacked" / "stray.txt").write_text("x")  # inside the copy: prepack's own check names it
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 2


def test_a_full_disk_while_copying_is_the_bundle_folder_s_failure_not_an_input_s(tiny_int8_export, wheel, tmp_path,
                                                                                  monkeypatch):
    # shutil.copyfile names the source when the destination's disk is full: the message blamed the
    # wheel (or model.onnx.data); it is the bundle folder that could not be written
    import errno
    import shutil as shutil_module

    from gemma_export import bundle

    real = shutil_module.copyfile

    def full_disk(src, dst, *args, **kwargs):
        if str(src).endswith(".whl"):
            raise OSError(errno.ENOSPC, "No space left on device", str(src))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(bundle.shutil, "copyfile", full_disk)
    out = tmp_path / "board"
    result = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out), "--wheel", str(wheel)])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {out}: writing the bundle failed (No space left on device: the disk (or its inodes) is full"), line
    assert str(wheel) not in line and not out.exists() and os.listdir(tmp_path) == []


def test_a_full_temporary_folder_for_the_wheel_build_is_one_line(tmp_path, monkeypatch):
    # copytree reports every failed file in one list: the message was that list, thousands of characters
    import shutil as shutil_module

    from gemma_export import bundle
    from gemma_export.errors import GemmaExportError

    def full(src, dst, *args, **kwargs):
        raise shutil_module.Error([(str(src) + "/a.py", str(dst) + "/a.py", "[Errno 28] No space left on device: 'x'")] * 50)

    monkeypatch.setattr(bundle.shutil, "copytree", full)
    with pytest.raises(GemmaExportError) as caught:
        bundle.build_wheel(tmp_path)
    message = str(caught.value)
    assert "cannot copy the toolkit's sources into" in message and "([Errno 28] No space left on device)" in message
    assert "point TMPDIR elsewhere" in message and len(message) < 300 and "\n" not in message
    # bundle builds it inside --out's staging folder: there TMPDIR does not matter (probe finding)
    with pytest.raises(GemmaExportError) as caught:
        bundle.build_wheel(tmp_path, scratch_dir=tmp_path)
    assert str(caught.value).endswith("; free space where the bundle is written (--out), or choose another --out")


def test_the_free_space_check_counts_the_wheel_s_real_size(tiny_int8_export, wheel, tmp_path, monkeypatch):
    # it kept 100 kB for a wheel of ~200 kB: a disk with room for the check filled during the copy
    from gemma_export import staging
    from gemma_export.errors import OutputError

    asked = []

    def record(out_dir, need_bytes, what):
        asked.append(need_bytes)
        raise OutputError("stop here")

    monkeypatch.setattr(staging, "check_free_space", record)
    model_bytes = sum(p.stat().st_size for p in tiny_int8_export.iterdir() if p.is_file())
    result = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(tmp_path / "b"),
                                 "--wheel", str(wheel)])
    assert result.exit_code == 2 and "stop here" in result.output
    assert wheel.stat().st_size > 10**5  # the old allowance was too small for it
    assert asked and asked[0] >= model_bytes + wheel.stat().st_size


def test_a_bundle_with_the_board_s_pre_packed_copy_is_replaced_by_a_new_bundle(tiny_int8_export, wheel, tmp_path):
    from gemma_export.prepack import prepack

    out = tmp_path / "board"
    bundle_args = ["bundle", "--model", str(tiny_int8_export), "--out", str(out), "--wheel", str(wheel)]
    assert runner.invoke(app, bundle_args).exit_code == 0
    prepack(out / "model")  # the bundle README's step on the board
    assert (out / "model" / "prepacked" / "prepacked.json").is_file()
    copy_mb = sum(p.stat().st_size for p in (out / "model" / "prepacked").rglob("*") if p.is_file()) / 1e6
    result = runner.invoke(app, bundle_args)
    assert result.exit_code == 0, result.output
    assert not (out / "model" / "prepacked").exists()  # the copy goes with the bundle it was made from
    # and the user is told so (helper-found: it went without a word)
    assert (f"the previous bundle's pre-packed copy {out / 'model' / 'prepacked'} ({copy_mb:,.1f} MB) is deleted with "
            "it (it was made from the files being replaced); run `gemma-export prepack --model model` on the board "
            "again") in result.stderr
    # and what the replaced bundle held, as an export says it (fresh-user finding: it went without a word)
    assert f"{out} holds an earlier bundle of an int8 export (" in result.stderr
    assert "; it is replaced once this one is written and checked" in result.stderr
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0
    # anything else added to model/ still makes the folder foreign
    (out / "model" / "notes.txt").write_text("mine")
    result = runner.invoke(app, bundle_args)
    assert result.exit_code == 2 and ("is not an unchanged bundle of gemma-export (a BUNDLE.json of ours listing every "
                                      "file in it: model/notes.txt is not listed in BUNDLE.json)") in result.stderr, result.output
    assert (out / "model" / "notes.txt").read_text() == "mine"
    # an edited file is named too (it said only "not an unchanged bundle"; helper-found)
    (out / "model" / "notes.txt").unlink()
    (out / "README.md").write_text((out / "README.md").read_text().replace("#", "=", 1))  # same size, other bytes
    result = runner.invoke(app, bundle_args)
    assert result.exit_code == 2 and "file in it: README.md differs from the sha256 BUNDLE.json records)" in result.stderr


@pytest.mark.parametrize("dtype, prepacked", [("int8", True), ("int4", True), ("bf16", False), ("fp32", False)])
def test_the_board_readme_pre_packs_quantized_weights_only(dtype, prepacked):
    # a pre-packed copy of float weights is 2-4 x the model and raises the peak: no prepack step,
    # and the README says why and which export is the board's
    from gemma_export.boards import board
    from gemma_export.bundle import _readme

    text = _readme("sl2610", board("sl2610"), "gemma_export-0.1.0-py3-none-any.whl",
                   {"dtype": dtype, "config": {"num_hidden_layers": 18, "vocab_size": 262144}})
    commands = [line.strip() for line in text.splitlines() if line.startswith("    ~/gx/bin/gemma-export ")]
    assert commands[0] == "~/gx/bin/gemma-export verify ."
    assert ("~/gx/bin/gemma-export prepack --model model" in commands) == prepacked
    assert ("pre-pack the weights" in text) == prepacked
    assert (f"The weights are {dtype}: onnxruntime computes with them in float32" in text) == (not prepacked)
    assert commands[-1] == "~/gx/bin/gemma-export bench --model model --board sl2610 --json ~/bench.json"
    assert "less than 300 MB of the\nboard's memory free" in text
    # each quantized dtype's own memory figures (an int4 bundle quoted the int8 export's)
    joined = " ".join(text.splitlines())
    assert ("0.15 × the model after a 512-token prompt and 128 steps with the KV cache in use, against 1.34 ×"
            in joined) == (dtype == "int4")
    assert ("0.09 × after a 512-token one and 128 steps with the KV cache in use, against 1.07 × and 1.148 ×"
            in joined) == (dtype == "int8")
    # float weights: the warning comes before the install steps, not only in the memory paragraph at the end
    warning = joined.find("**Too large for the sl2610's memory:**")
    assert (warning != -1) == (not prepacked)
    if warning != -1:
        assert warning < joined.find("Install from inside this folder")
        assert f"holds {dtype} weights as float32, and the 270M's bf16 export peaked at 1.92–2.02 GB" in joined


def test_bundle_of_float_weights_says_on_the_console_that_they_are_not_the_boards(tiny_dir, wheel, tmp_path):
    from conftest import write_char_tokenizer

    from gemma_export.exporter import export

    src = tmp_path / "src"  # the tiny source with a tokenizer (a bundle needs one)
    shutil.copytree(tiny_dir, src)
    write_char_tokenizer(src)
    lines = {}
    for dtype in ("bf16", "int8"):
        model = export(src, tmp_path / dtype, dtype, **({"block_size": 16} if dtype == "int8" else {})).out_dir
        result = runner.invoke(app, ["bundle", "--model", str(model), "--out", str(tmp_path / f"board-{dtype}"),
                                     "--wheel", str(wheel)])
        assert result.exit_code == 0, result.output
        lines[dtype] = [x for x in result.stderr.splitlines() if x.startswith("note: the weights are")]
    assert lines["int8"] == []
    assert lines["bf16"] == ["note: the weights are bf16: onnxruntime holds them as float32 (4 bytes a weight; the "
                             "270M's bf16 export peaked at 1.92 to 2.02 GB, over the sl2610's 1.9 GB); the int8 or int4 "
                             "export is the one for the board"], result.stderr


def test_bundle_says_what_it_does_and_which_leftover_it_removes(tiny_int8_export, wheel, tmp_path):
    # a bundle killed earlier (SIGKILL: no cleanup) left its staging folder beside the output; the
    # next bundle removes it and says so, and each step gets a progress line on stderr
    import os
    import time

    from gemma_export.staging import STALE_AFTER_SECONDS

    out = tmp_path / "board"
    dead = tmp_path / ".board.staging-dead_123"
    (dead / "model").mkdir(parents=True)
    (dead / "model" / "model.onnx.data").write_bytes(b"x" * 100)
    old = time.time() - 2 * STALE_AFTER_SECONDS
    os.utime(dead, (old, old))
    result = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out), "--wheel", str(wheel)])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines[0] == f"removed {dead}, left by an earlier gemma-export"
    listed = len(json.loads((tiny_int8_export / 'manifest.json').read_text())['files'])
    assert lines[1].startswith(f"copying {listed + 1} model files (")  # and the manifest
    assert len(list((out / "model").iterdir())) == listed + 1
    assert lines[2] == "checking the copies against the model's manifest ..."
    assert not dead.exists() and sorted(os.listdir(tmp_path)) == ["board"]


def test_the_wheel_is_built_in_the_given_scratch_folder_and_pip_dies_with_a_killed_bundle(tmp_path, monkeypatch):
    # bundle builds its wheel inside its staging folder, so a SIGKILLed bundle leaves nothing in the
    # system's temporary folder (the next bundle removes the staging folder), and pip, which a
    # SIGKILL of its parent would leave running, dies with it
    import os
    import signal
    import subprocess
    import sys
    import time

    from gemma_export import bundle as bundle_module

    seen = {}

    def fake_pip(command, env):
        seen["tmpdir"] = env["TMPDIR"]
        return subprocess.CompletedProcess(command, 1, "", "pip: no\n")

    monkeypatch.setattr(bundle_module, "_run_in_own_group", fake_pip)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(GemmaExportError, match="building the gemma_export wheel .* failed: pip: no"):
        bundle_module.build_wheel(tmp_path / "dest", scratch_dir=scratch)
    assert Path(seen["tmpdir"]).is_relative_to(scratch) and list(scratch.iterdir()) == []

    # a full disk while pip builds: its last line ("note: This error originates from a subprocess")
    # hid the cause (probe finding); and a failure's last line that is not pip's boilerplate
    for stderr, said in (
            ("  OSError: [Errno 28] No space left on device: 'build/lib'\nerror: subprocess-exited-with-error\n"
             "note: This error originates from a subprocess, and is likely not a problem with pip.\n",
             "failed: no space left on device; free space where the bundle is written (--out), or choose another "
             "--out"),
            ("error: invalid pyproject.toml\nnote: This error originates from a subprocess, and is likely not a "
             "problem with pip.\nhint: see above\n", "failed: error: invalid pyproject.toml")):
        monkeypatch.setattr(bundle_module, "_run_in_own_group",
                            lambda command, env, stderr=stderr: subprocess.CompletedProcess(command, 1, "", stderr))
        with pytest.raises(GemmaExportError) as info:
            bundle_module.build_wheel(tmp_path / "dest", scratch_dir=scratch)
        assert str(info.value).endswith(said), str(info.value)

    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", "import os, sys\n"
                               "from gemma_export.bundle import _run_in_own_group\n"
                               f"_run_in_own_group([sys.executable, '-c', {child!r}], dict(os.environ))\n"])
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the command outlived its SIGKILLed parent")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_inspect_of_a_bundle_folder_reads_its_export(tiny_int8_export, wheel, tmp_path):
    out = tmp_path / "board"
    assert runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out), "--wheel", str(wheel)]).exit_code == 0
    direct = runner.invoke(app, ["inspect", str(tiny_int8_export / "model.onnx"), "--json"])
    via_bundle = runner.invoke(app, ["inspect", str(out), "--json"])
    assert via_bundle.exit_code == 0, via_bundle.output
    a, b = json.loads(direct.stdout), json.loads(via_bundle.stdout)
    assert b["path"] == str(out / "model" / "model.onnx")
    assert {k: v for k, v in a.items() if k != "path"} == {k: v for k, v in b.items() if k != "path"}


def test_files_under_model_prepacked_that_no_prepack_wrote_are_neither_verified_nor_deleted(tiny_int8_export, wheel,
                                                                                          tmp_path):
    """A prepacked.json of {} beside a script: verify_bundle and verify_manifest passed it (only the
    record's name was looked at), and a bundle written over the folder deleted the script."""
    from gemma_export.bundle import verify_bundle
    from gemma_export.errors import VerificationError
    from gemma_export.verify import verify_manifest

    out = tmp_path / "board"
    assert runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out),
                               "--wheel", str(wheel)]).exit_code == 0
    foreign = out / "model" / "prepacked"
    foreign.mkdir()
    (foreign / "prepacked.json").write_text("{}")
    (foreign / "run.sh").write_text("echo mine\n")
    for check in (verify_bundle, lambda folder: verify_manifest(folder / "model")):
        with pytest.raises(VerificationError, match=r"model/prepacked: has a prepacked\.json without \"format\": .*; not a "
                                                    r"copy gemma-export wrote"):
            check(out)
    again = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out), "--wheel", str(wheel)])
    assert again.exit_code == 2 and (foreign / "run.sh").read_text() == "echo mine\n"


def test_an_unreadable_listing_is_a_verification_error_not_an_oserror(tmp_path, monkeypatch):
    """The Python API let the OSError of an unreadable BUNDLE.json through (EACCES, EIO), where
    every other problem of the listing is a VerificationError naming it."""
    import builtins
    import errno
    import os

    from gemma_export import verify_bundle
    from gemma_export.errors import VerificationError

    (tmp_path / "BUNDLE.json").write_text("{}")
    real_open = builtins.open

    def refusing_open(file, *args, **kwargs):
        if os.fspath(file).endswith("BUNDLE.json"):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing_open)
    with pytest.raises(VerificationError, match=r"BUNDLE\.json: cannot be read \(Permission denied\)$"):
        verify_bundle(tmp_path)


def test_an_interrupt_while_bundle_reports_says_the_bundle_is_written(tiny_int8_export, wheel, tmp_path, monkeypatch):
    """bundle, prepack and dedupe print what they did after their body: an interrupt there said only
    'error: interrupted' about a folder already in place (helper-found, 11 prepack runs)."""
    from gemma_export import cli
    from gemma_export.console import Terminated

    def interrupted(*_args):
        raise Terminated
    monkeypatch.setattr(cli, "_list_files", interrupted)
    out = tmp_path / "board"
    result = runner.invoke(app, ["bundle", "--model", str(tiny_int8_export), "--out", str(out), "--wheel", str(wheel)])
    assert result.exit_code == 143, result.output
    assert result.stderr.endswith(f"error: interrupted; the bundle {out} is written and complete "
                                  f"(`gemma-export verify {out}` checks it)\n"), result.stderr
    monkeypatch.undo()
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0


@pytest.mark.parametrize("dtype, quantization, described, float16", [
    ("int8", {"block_size": 16, "table_block_size": 128, "hadamard_size": 64, "scale_dtype": "float16",
              "activation_residual": True, "calibration": {"method": "gptq"}},
     "weights int8 (16 weights per scale in the layers, 128 in the table, Hadamard 64, float16 scales, "
     "activation residual, GPTQ codes);", True),
    ("int4", {"block_size": 32, "table_block_size": 64, "table_dtype": "int8", "hadamard_size": 0,
              "scale_dtype": "float32", "symmetric": False, "scale_method": "rtn", "calibration": None},
     "weights int4 (32 weights per scale in the layers, 64 in the int8 table, no rotation, float32 scales, "
     "4-bit zero points, largest-magnitude scales, codes rounded to nearest);", False),
    ("int4", {"block_size": 32, "table_block_size": 32, "table_dtype": "int4", "hadamard_size": 64,
              "symmetric": True, "scale_method": "mse", "calibration": {"method": "gptq"}},
     "weights int4 (32 weights per scale in the layers, 32 in the table, Hadamard 64, clipping-search scales, "
     "GPTQ codes);", False),
    ("int8", {"block_size": "16", "table_block_size": True, "scale_dtype": "bf16", "activation_residual": "yes"},
     "weights int8;", False),  # values of another type (fields the graph cannot show) are left out
    ("fp32", None, "weights fp32;", False),
])
def test_the_board_readme_says_how_the_weights_were_quantized(dtype, quantization, described, float16):
    """The bundle README's model line carries the export's quantization record, so two bundles of
    differently made int8 exports are told apart on the board; float16 scales come with the
    graph-optimization warning (fresh-user finding: the README was the same for both)."""
    from gemma_export.boards import board
    from gemma_export.bundle import _readme

    manifest = {"dtype": dtype, "config": {"num_hidden_layers": 18, "vocab_size": 262144}}
    if quantization is not None:
        manifest["quantization"] = quantization
    text = _readme("sl2610", board("sl2610"), "gemma_export-0.1.0-py3-none-any.whl", manifest)
    assert f"Model: Gemma 3, 18 layers, vocabulary 262144, {described}\n" in text
    assert ("Its block scales are stored as float16" in text) == float16
    assert ("with them off onnxruntime computes wrong products" in text) == float16
