"""`gemma-export inspect`: sizes, top tensors, and exactly the planted duplicates."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import save_file
from typer.testing import CliRunner

from gemma_export.cli import app
from gemma_export.exporter import export
from gemma_export.inspect import inspect_path

rng = np.random.default_rng(0)


def _groups(report):
    return sorted((g.kind, tuple(sorted(g.names))) for g in report.duplicates)


def test_safetensors_duplicate_under_another_name_and_flat_copy(tmp_path):
    table = rng.standard_normal((512, 64)).astype(np.float32)  # 128 KiB
    other = rng.standard_normal((512, 64)).astype(np.float32)
    path = tmp_path / "dup.safetensors"
    save_file({"t0": table, "t5": other, "t2044": table.copy(), "flat": table.reshape(-1).copy(),
               "norm_a": np.ones(64, np.float32), "norm_b": np.ones(64, np.float32)}, str(path))
    report = inspect_path(path)
    assert report.format == "safetensors" and len(report.tensors) == 6
    assert _groups(report) == [("identical bytes", ("flat", "t0", "t2044"))]  # small norms not flagged
    assert report.duplicates[0].wasted_bytes == 2 * table.nbytes
    assert report.total_elements == 4 * 512 * 64 + 128


def test_transposed_copy_is_found_and_near_copy_is_not(tmp_path):
    table = rng.standard_normal((1024, 32)).astype(np.float32)
    near = table.T.copy()
    near[3, 5] += 1e-3
    path = tmp_path / "t.safetensors"
    save_file({"embed": table, "head_t": table.T.copy(), "near_t": near}, str(path))
    assert _groups(inspect_path(path)) == [("transposed", ("embed", "head_t"))]


def _table_stored_twice(path) -> np.ndarray:
    """An ONNX model at ``path`` (data in ``m.onnx.data``) whose Gather and Gemm read two identical
    copies of one [1024, 64] table; returns the table."""
    table = rng.standard_normal((1024, 64)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["embed", "ids"], ["e"]),
             helper.make_node("Gemm", ["x", "head"], ["y"], transB=1)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None]),
                     helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 64])],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, None), helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(table, "embed"), numpy_helper.from_array(table.copy(), "head")])
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    return table


def test_onnx_initializer_stored_twice(tmp_path):
    path = tmp_path / "m.onnx"
    _table_stored_twice(path)
    report = inspect_path(path)
    assert _groups(report) == [("identical bytes", ("embed", "head"))]
    assert report.consumers == {"embed": ["Gather"], "head": ["Gemm"]}
    result = CliRunner().invoke(app, ["inspect", str(path)])
    assert "identical bytes: embed, head — one table stored 2 times (50.0% each)" in result.stdout
    assert "consumers of the largest 2 initializers:" in result.stdout  # both, not "the largest 10"


def test_external_data_without_length_is_sized_from_its_dims_and_a_wrong_length_is_named(tmp_path):
    """``length`` is optional in ONNX (onnxruntime loads such a model): inspect and dedupe read the
    size from the dims; a ``length`` the dims contradict is refused by name."""
    from gemma_export.dedupe import dedupe
    from gemma_export.errors import FormatError

    path = tmp_path / "m.onnx"
    table = _table_stored_twice(path)
    model = onnx.load(str(path), load_external_data=False)
    for t in model.graph.initializer:
        kept = [(e.key, e.value) for e in t.external_data if e.key != "length"]
        del t.external_data[:]
        for key, value in kept:
            t.external_data.add(key=key, value=value)
    onnx.save(model, str(path))
    report = inspect_path(path)
    assert report.total_bytes == 2 * table.nbytes
    assert _groups(report) == [("identical bytes", ("embed", "head"))]
    assert dedupe(path, tmp_path / "out").removed == ["head"]
    model.graph.initializer[0].external_data.add(key="length", value="100")
    onnx.save(model, str(path))
    with pytest.raises(FormatError, match=r"m.onnx: initializer 'embed' declares 100 bytes of external data; its shape "
                                          r"\[1024, 64\] and data type need 262,144"):
        inspect_path(path)



def _external(tmp_path, data_type, dims, data_bytes: int, **entries):
    """A model whose one initializer ``w`` keeps its data in ``w.bin`` (``data_bytes`` long) with
    the given external-data ``entries`` (offset, length)."""
    (tmp_path / "w.bin").write_bytes(b"\0" * data_bytes)
    t = TensorProto(name="w", data_type=data_type, dims=dims, data_location=TensorProto.EXTERNAL)
    t.external_data.add(key="location", value="w.bin")
    for key, value in entries.items():
        t.external_data.add(key=key, value=str(value))
    return helper.make_model(helper.make_graph([], "g", [], [], initializer=[t]))


@pytest.mark.parametrize("tensor, message", [
    (TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[-3, 4], raw_data=b"\0" * 16),
     "initializer 'w' has shape [-3, 4]; dimensions must not be negative"),
    (TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[5], raw_data=b"\0" * 16),
     "initializer 'w' holds 16 bytes of data; its shape [5] and data type need 20"),
    (TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2**40, 2**40], raw_data=b"\0" * 16),
     "initializer 'w' holds 16 bytes of data; its shape [1099511627776, 1099511627776] and data type need"),
    (TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[3], float_data=[1.0, 2.0]),
     "initializer 'w' data does not fit its shape [3]"),
])
def test_inline_data_that_does_not_fill_its_shape_is_refused(tmp_path, tensor, message):
    """inspect took such tensors at their word (helper-found): "total elements: -12 = -48 B fp32",
    or 4 PiB for 16 bytes, exit 0; external data with the same mismatch was already refused."""
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(helper.make_graph([], "g", [], [], initializer=[tensor])), str(path))
    result = CliRunner().invoke(app, ["inspect", str(path)])
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {path}: {message}"), result.output
    assert len(result.stderr.splitlines()) == 1


def test_external_data_sizes_pack_4_bit_types_two_per_byte_and_name_a_negative_offset(tmp_path):
    from gemma_export.errors import FormatError
    from gemma_export.onnx_files import check_external_data, tensor_bytes

    # 3 int4 values take 2 bytes (the last half empty), 6 uint4 values 3
    assert tensor_bytes(_external(tmp_path, TensorProto.INT4, [3], 2).graph.initializer[0]) == 2
    assert tensor_bytes(_external(tmp_path, TensorProto.UINT4, [2, 3], 3).graph.initializer[0]) == 3
    assert tensor_bytes(_external(tmp_path, TensorProto.FLOAT16, [5], 10).graph.initializer[0]) == 10
    assert tensor_bytes(TensorProto(name="s", data_type=TensorProto.STRING, dims=[2])) is None
    assert check_external_data(_external(tmp_path, TensorProto.INT4, [3], 2, offset=0, length=2), tmp_path / "m.onnx") == {"w.bin": 2}
    with pytest.raises(FormatError, match="declares 1 bytes of external data; its shape \\[3\\] and data type need 2"):
        check_external_data(_external(tmp_path, TensorProto.INT4, [3], 2, length=1), tmp_path / "m.onnx")
    # a negative offset is outside the file, however short the data
    with pytest.raises(FormatError, match=r"initializer 'w' data \[-4, 12\) lies outside the file's 20 bytes"):
        check_external_data(_external(tmp_path, TensorProto.FLOAT, [4], 20, offset=-4, length=16), tmp_path / "m.onnx")
    # an absent length is added to the model from the dims, for later readers of the entries
    model = _external(tmp_path, TensorProto.FLOAT, [4], 20, offset=4)
    assert check_external_data(model, tmp_path / "m.onnx") == {"w.bin": 20}
    assert {e.key: e.value for e in model.graph.initializer[0].external_data}["length"] == "16"


def _outside_tensor(name="c", location="../secret.bin"):
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    t.external_data.add(key="location", value=location)
    return t


@pytest.mark.parametrize("where", ["Constant", "subgraph", "function", "sparse", "sparse indices", "tensors attribute",
                                   "graphs attribute", "Constant sparse_value"])
def test_external_data_outside_initializers_is_checked_too(tmp_path, where):
    """Only graph.initializer was checked: a Constant's tensor, a subgraph's initializer, a
    function's Constant or a sparse initializer could name '../secret.bin', which `dedupe` then
    read and copied into its output."""
    (tmp_path / "secret.bin").write_bytes(b"\0" * 16)
    folder = tmp_path / "m"
    folder.mkdir()
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    constant = helper.make_node("Constant", [], ["y"], name="c", value=_outside_tensor())
    functions = []
    if where == "Constant":
        graph = helper.make_graph([constant], "g", [], [out])
        label = "tensor of node 'c' attribute 'value'"
    elif where == "subgraph":
        branch = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "b", [], [out],
                                   initializer=[_outside_tensor("w", "/etc/passwd")])
        cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
        graph = helper.make_graph([helper.make_node("If", ["cond"], ["y"], name="if", then_branch=branch,
                                                    else_branch=branch)], "g", [cond], [out])
        label = "initializer 'w' keeps its data at '/etc/passwd'"
    elif where == "function":
        functions = [helper.make_function("local", "F", [], ["y"], [constant], [helper.make_opsetid("", 21)])]
        graph = helper.make_graph([helper.make_node("F", [], ["y"], domain="local")], "g", [], [out])
        label = "tensor of node 'c' attribute 'value'"
    elif where == "sparse":
        indices = helper.make_tensor("i", TensorProto.INT64, [1], [0])
        sparse = helper.make_sparse_tensor(_outside_tensor("s"), indices, [4])
        graph = helper.make_graph([helper.make_node("Identity", ["s"], ["y"])], "g", [], [out])
        graph.sparse_initializer.append(sparse)
        label = "sparse initializer 's' values"
    elif where == "sparse indices":
        indices = _outside_tensor("i")
        indices.data_type = TensorProto.INT64
        indices.dims[:] = [1]
        sparse = helper.make_sparse_tensor(helper.make_tensor("s", TensorProto.FLOAT, [1], [1.0]), indices, [4])
        graph = helper.make_graph([helper.make_node("Identity", ["s"], ["y"])], "g", [], [out])
        graph.sparse_initializer.append(sparse)
        label = "sparse initializer 's' indices"
    elif where == "tensors attribute":  # a custom-domain node with a list of tensors
        node = helper.make_node("Holder", [], ["y"], name="h", domain="local")
        node.attribute.append(helper.make_attribute("weights", [_outside_tensor("a")]))
        graph = helper.make_graph([node], "g", [], [out])
        label = "tensor of node 'h' attribute 'weights'"
    elif where == "graphs attribute":
        branch = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "b", [], [out],
                                   initializer=[_outside_tensor("w")])
        node = helper.make_node("Holder", [], ["y"], name="h", domain="local")
        node.attribute.append(helper.make_attribute("bodies", [branch]))
        graph = helper.make_graph([node], "g", [], [out])
        label = "initializer 'w' keeps its data at '../secret.bin'"
    else:
        indices = helper.make_tensor("i", TensorProto.INT64, [1], [0])
        node = helper.make_node("Constant", [], ["y"], name="c",
                                sparse_value=helper.make_sparse_tensor(_outside_tensor("s"), indices, [4]))
        graph = helper.make_graph([node], "g", [], [out])
        label = "tensor of node 'c' attribute 'sparse_value' values"
    model = helper.make_model(graph, functions=functions, opset_imports=[helper.make_opsetid("", 21),
                                                                         helper.make_opsetid("local", 1)])
    path = folder / "model.onnx"
    onnx.save(model, str(path))
    for command in (["inspect", str(path)], ["dedupe", str(path), "--out", str(tmp_path / "out")]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith(f"error: {path}: {label}"), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "secret.bin"]  # no output


def test_our_export_has_no_duplicates_and_a_shared_table(tiny_dir, tmp_path):
    out = export(tiny_dir, tmp_path / "e", "int8", block_size=16).out_dir
    result = CliRunner().invoke(app, ["inspect", str(out / "model.onnx"), "--json", "--top", "1000"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["duplicates"] == []
    assert data["consumers"]["model.embed_tokens.weight"] == ["Gather", "MatMulNBits"]
    table = next(t for t in data["largest"] if t["name"] == "model.embed_tokens.weight")
    assert table["dtype"] == "UINT8" and table["shape"] == [96, 1, 64] and table["bytes"] == 96 * 64
    # the export folder stands for its model.onnx: the same report
    folder = CliRunner().invoke(app, ["inspect", str(out), "--json", "--top", "1000"])
    assert folder.exit_code == 0 and json.loads(folder.stdout) == data
    # --model, as the other commands take the folder (a fresh user's first try)
    as_option = CliRunner().invoke(app, ["inspect", "--model", str(out), "--json", "--top", "1000"])
    assert as_option.exit_code == 0 and json.loads(as_option.stdout) == data
    both = CliRunner().invoke(app, ["inspect", str(out), "--model", str(tmp_path)])
    assert both.exit_code == 2 and f"inspect: two paths given ({out} and --model {tmp_path}); give one" in both.output
    none = CliRunner().invoke(app, ["inspect"])
    assert none.exit_code == 2 and "inspect: no path given (gemma-export inspect PATH, or --model PATH)" in none.output
    printed = CliRunner().invoke(app, ["inspect", str(out)]).stdout
    data_bytes = sum(t["bytes"] for t in data["largest"])
    assert f"tensor data {data_bytes:,} bytes" in printed
    assert data_bytes <= (out / "model.onnx.data").stat().st_size + (out / "model.onnx").stat().st_size
    # each dtype's bytes in a unit that shows them: the tiny table's 6,144 bytes are KiB, not "0.0 MiB"
    by_dtype = {}
    for t in data["largest"]:
        by_dtype[t["dtype"]] = by_dtype.get(t["dtype"], 0) + t["bytes"]
    line = next(x for x in printed.splitlines() if x.startswith("bytes by dtype: "))
    assert "0.0 MiB" not in line and f"UINT8 {by_dtype['UINT8'] / 1024:.1f} KiB" in line, line
    assert all(f"{k} " in line for k in by_dtype), line
    assert "largest 0:" not in CliRunner().invoke(app, ["inspect", str(out), "--top", "0"]).stdout


@pytest.mark.parametrize("size, shown", [(1023, "1,023 B"), (1024, "1.0 KiB"), (1_048_575, "1.0 MiB"),
                                         (2**30 - 1, "1.00 GiB"), (5 * 2**20, "5.0 MiB"), (0, "0 B")])
def test_sizes_are_shown_in_the_unit_they_reach_once_rounded(size, shown):
    from gemma_export.inspect import Report, TensorEntry, format_report

    entry = TensorEntry("w", (size,), "UINT8", size, size, None, 0)
    line = next(x for x in format_report(Report("m.onnx", "onnx", [entry], [], {})).splitlines()
                if x.startswith("bytes by dtype: "))
    assert line == f"bytes by dtype: UINT8 {shown}"


def test_bad_files_get_one_line(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 8 + b"{}")
    result = CliRunner().invoke(app, ["inspect", str(bad)])
    assert result.exit_code == 2 and "header length" in result.stderr
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "missing.onnx")])
    assert result.exit_code == 2 and "missing.onnx: no such .onnx, .safetensors, .gguf or .mlir file" in result.stderr
    result = CliRunner().invoke(app, ["inspect", "/dev/null"])  # exists, but is no file to read
    assert result.exit_code == 2 and "/dev/null: not a regular file; expected a" in result.stderr


@pytest.mark.slow
def test_real_gguf_has_no_false_duplicates():
    from gemma_export.sources import bundled_gguf_path

    report = inspect_path(bundled_gguf_path())
    assert report.duplicates == [] and report.total_elements == 268_098_176


def test_same_values_in_two_precisions(tmp_path):
    import ml_dtypes

    table = rng.standard_normal((512, 128)).astype(np.float32)
    bf16_nearest = table.astype(ml_dtypes.bfloat16)
    bf16_truncated = (table.view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)
    other = rng.standard_normal((512, 128)).astype(ml_dtypes.bfloat16)
    path = tmp_path / "mixed.safetensors"
    save_file({"f32": table, "bf16_rne": bf16_nearest, "bf16_trunc": bf16_truncated.reshape(-1), "other": other}, str(path))
    groups = _groups(inspect_path(path))
    assert ("same values, two precisions", ("bf16_rne", "f32")) in groups
    assert ("same values, two precisions", ("bf16_trunc", "f32")) in groups
    assert not any("other" in names for _, names in groups)


def _int8_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scale = (np.abs(x).max(axis=1) / 127).astype(np.float32)
    return np.clip(np.rint(x / scale[:, None]), -127, 127).astype(np.int8), scale


def test_int8_copy_with_scales_is_the_same_table(tmp_path):
    import ml_dtypes

    table = rng.standard_normal((512, 128)).astype(np.float32)
    q, scale = _int8_rows(table)
    other_q, other_scale = _int8_rows(rng.standard_normal((512, 128)).astype(np.float32))
    huge = np.full(512, 1e6, np.float32)  # a degenerate scale: q all zero "quantizes" anything
    path = tmp_path / "ref.safetensors"
    save_file({"t0": table.astype(ml_dtypes.bfloat16).reshape(-1), "t9": q.reshape(-1), "t9_scale": scale,
               "t4": other_q, "t4_scale": other_scale, "t7": np.zeros_like(q), "t7_scale": huge}, str(path))
    report = inspect_path(path)
    assert [(g.kind, g.names) for g in report.duplicates] == [
        ("same values after dequantization", ("t0", "t9", "t9_scale"))]
    assert report.duplicates[0].wasted_bytes == q.nbytes + scale.nbytes  # dropping the int8 copy
    result = CliRunner().invoke(app, ["inspect", str(path)])
    assert "t0, t9, t9_scale — one table stored 2 times" in result.stdout


def test_onnx_dequantize_linear_and_gguf_q8_0_copies(tmp_path):
    import gguf

    table = rng.standard_normal((512, 256)).astype(np.float32)
    q, scale = _int8_rows(table)
    nodes = [helper.make_node("Gather", ["embed", "ids"], ["e"]),
             helper.make_node("DequantizeLinear", ["head_q", "head_scale"], ["head"], axis=0),
             helper.make_node("Gemm", ["x", "head"], ["y"], transB=1)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None]),
                     helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 256])],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, None), helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(table, "embed"), numpy_helper.from_array(q, "head_q"), numpy_helper.from_array(scale, "head_scale")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    assert _groups(inspect_path(path)) == [("same values after dequantization", ("embed", "head_q", "head_scale"))]

    gpath = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(gpath), "gemma3")
    w.add_tensor("token_embd.weight", table)
    q8 = gguf.quants.quantize(table, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    q8_other = gguf.quants.quantize(rng.standard_normal((512, 256)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", q8_other, raw_shape=q8_other.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert _groups(inspect_path(gpath)) == [("same values after dequantization", ("output.weight", "token_embd.weight"))]


@pytest.mark.parametrize("bits", [8, 4])
def test_a_float_table_stored_again_as_matmulnbits_codes(tmp_path, bits, monkeypatch):
    """A float table for the lookup and the same table as a MatMulNBits head (its codes uint8 with
    the implicit zero point 2 ** (bits - 1), 4-bit ones two per byte) was reported as no duplicate:
    the codes were read as if their zero point were 0 and their bytes one code each."""
    from quant.int4 import BlockInt4Weights
    from quant.int8 import BlockInt8Weights

    local = np.random.default_rng(7)  # the module's generator feeds the later tests their tables
    table = local.standard_normal((1024, 128)).astype(np.float32)
    other = local.standard_normal((1024, 128)).astype(np.float32)

    def nbits(w):
        if bits == 8:
            q = BlockInt8Weights.quantize(w, 32)
        else:
            q = BlockInt4Weights.quantize(w, 32, method="rtn")
        return q.data, q.scales

    head, head_scales = nbits(table)
    decoy, decoy_scales = nbits(other)  # other values, same layout: not a copy of the table
    attrs = dict(K=128, N=1024, bits=bits, block_size=32, domain="com.microsoft")
    nodes = [helper.make_node("Gather", ["embed", "ids"], ["e"]),
             helper.make_node("MatMulNBits", ["x", "head", "head_scales"], ["y"], **attrs),
             helper.make_node("MatMulNBits", ["x", "decoy", "decoy_scales"], ["z"], **attrs)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None]),
                     helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 128])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "eyz"],
        [numpy_helper.from_array(a, n) for n, a in (("embed", table), ("head", head), ("head_scales", head_scales),
                                                     ("decoy", decoy), ("decoy_scales", decoy_scales))])
    path = tmp_path / "m.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    groups = inspect_path(path).duplicates
    assert [(g.kind, g.names) for g in groups] == [("same values after dequantization", ("embed", "head", "head_scales"))]
    assert groups[0].wasted_bytes == head.nbytes + head_scales.nbytes  # the smaller copy: codes and scales
    # a real table is read in many chunks: each later chunk must start at its own byte (half its
    # code offset at 4 bits), as the first does
    import gemma_export.inspect as inspect_module
    monkeypatch.setattr(inspect_module._dequantized_chunks, "__defaults__", (1000,))
    assert [g.names for g in inspect_path(path).duplicates] == [("embed", "head", "head_scales")]
    monkeypatch.undo()

    # a float value 20 times its block's largest is no rounding of the codes, though clipping it to
    # the code range gives the very code stored there (the largest's)
    far = table.copy()
    j = int(np.abs(far[5, :32]).argmax())
    far[5, j] *= 20
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(far, "embed"))
    onnx.save(model, str(path), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    assert inspect_path(path).duplicates == []
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(table, "embed"))

    # zero points computed in the graph (here 0 from a Constant node) make other weights of the
    # same codes: they were read as the implicit 2 ** (bits - 1) and the head reported as a copy
    zero = helper.make_node("Constant", [], ["zp"], value=numpy_helper.from_array(
        np.zeros((1024, 4 if bits == 8 else 2), np.uint8), "zp_value"))
    model.graph.node.insert(0, zero)
    model.graph.node[2].input.append("zp")  # the head's MatMulNBits
    onnx.save(model, str(path), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    assert inspect_path(path).duplicates == []


def test_a_table_stored_three_times_identical_and_transposed(tmp_path):
    from gemma_export.dedupe import dedupe

    table = rng.standard_normal((1024, 64)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["embed", "ids"], ["e"]),
             helper.make_node("Gemm", ["x", "head"], ["y"], transB=1),
             helper.make_node("MatMul", ["x", "head_t"], ["z"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None]),
                     helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 64])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("e", "y", "z")],
        [numpy_helper.from_array(table, "embed"), numpy_helper.from_array(table.copy(), "head"),
         numpy_helper.from_array(table.T.copy(), "head_t")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    assert _groups(inspect_path(path)) == [("identical bytes", ("embed", "head")), ("transposed", ("embed", "head_t"))]
    result = dedupe(path, tmp_path / "one")
    assert sorted(result.removed) == ["head", "head_t"] and result.max_abs_diff <= 1e-4
    assert [t.name for t in inspect_path(result.out_path).tensors if t.nbytes >= table.nbytes] == ["embed"]


@pytest.mark.parametrize("command", [["inspect"], ["dedupe", "--out", "{tmp}/out"]])
def test_an_initializer_of_unknown_data_type_is_named(tmp_path, command):
    weight = numpy_helper.from_array(rng.standard_normal((64, 8)).astype(np.float32), "w")
    weight.data_type = 999  # not an ONNX tensor type (a newer or corrupt writer)
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [weight])
    path = tmp_path / "m.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())
    result = CliRunner().invoke(app, [*(a.format(tmp=tmp_path) for a in command), str(path)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error: {path}: initializer 'w' has data_type 999, not an ONNX tensor type"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def _two_initializer_model(tmp_path, second_name: str, share_offset: bool):
    """A Gather model with a 256 x 128 float32 table and a second initializer of the same bytes,
    written with external data; the second then renamed, and/or pointed at the first's bytes."""
    from onnx.external_data_helper import convert_model_to_external_data

    table = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["a"]), helper.make_node("Gather", ["copy", "ids"], ["b"])], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("a", "b")],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(table, "copy")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    convert_model_to_external_data(model, location="model.onnx.data", size_threshold=0)
    onnx.save(model, str(tmp_path / "model.onnx"))
    model = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    first, second = model.graph.initializer
    if share_offset:
        del second.external_data[:]
        second.external_data.extend(first.external_data)
    second.name = second_name
    model.graph.node[1].input[0] = second_name
    onnx.save(model, str(tmp_path / "model.onnx"))
    return tmp_path / "model.onnx", table.nbytes


def test_initializers_sharing_their_bytes_are_not_counted_as_duplicates(tmp_path):
    # two names reading one stored copy: nothing is wasted on disk (it reported the whole table as
    # wasted and dedupe claimed to save it), while a real second copy is still found
    path, nbytes = _two_initializer_model(tmp_path, "copy", share_offset=True)
    assert (tmp_path / "model.onnx.data").stat().st_size == 2 * nbytes  # the unused second copy stays in the file
    assert _groups(inspect_path(path)) == []
    (tmp_path / "real").mkdir()
    real, _ = _two_initializer_model(tmp_path / "real", "copy", share_offset=False)
    assert [g.wasted_bytes for g in inspect_path(real).duplicates] == [nbytes]


def test_an_initializer_name_defined_twice_is_refused_by_inspect_and_dedupe(tmp_path):
    # onnxruntime cannot load such a graph: it was reported as a duplicate, and dedupe found nothing to do
    path, _ = _two_initializer_model(tmp_path, "table", share_offset=False)
    for args in (["inspect", str(path)], ["dedupe", str(path), "--out", str(tmp_path / "out")]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        assert result.stderr.strip() == f"error: {path}: initializer name 'table' defined more than once; a graph " \
                                        "names each initializer once"
    assert not (tmp_path / "out").exists()


def test_float16_scales_behind_a_cast_are_read_as_the_scales_they_are(tiny_dir, tmp_path):
    """--scale-dtype float16 feeds MatMulNBits and the lookup through a Cast: inspect pairs every
    weight with its scales as for float32 scales (it paired them by name only, as 8-bit codes with
    zero point 0, int4 included) and names the Cast's readers as the scales' consumers."""
    from gemma_export.inspect import _onnx_entries

    for dtype in ("int8", "int4"):
        wide = export(tiny_dir, tmp_path / f"{dtype}-wide", dtype, block_size=16, calibrate=False).out_dir
        half = export(tiny_dir, tmp_path / f"{dtype}-half", dtype, block_size=16, calibrate=False,
                      scale_dtype="float16").out_dir
        _, wide_consumers, wide_pairs = _onnx_entries(wide / "model.onnx")
        _, half_consumers, half_pairs = _onnx_entries(half / "model.onnx")
        assert len(half_pairs) == len(wide_pairs) == 17
        assert sorted(half_pairs) == sorted(wide_pairs)
        assert half_consumers == wide_consumers
        assert sorted(half_consumers["model.embed_tokens.weight_scales"]) == ["Gather", "MatMulNBits"]


def test_only_a_table_read_by_a_lookup_and_a_matmul_is_called_shared(tiny_dir, tmp_path):
    out = export(tiny_dir, tmp_path / "e", "int8", block_size=16).out_dir
    printed = CliRunner().invoke(app, ["inspect", str(out), "--top", "1000"]).stdout
    assert "  model.embed_tokens.weight: Gather, MatMulNBits (shared by a lookup and a matmul)" in printed
    path = tmp_path / "m.onnx"
    _table_stored_twice(path)  # one copy read by the Gather, the other by the Gemm: neither is shared
    printed = CliRunner().invoke(app, ["inspect", str(path)]).stdout
    assert "  embed: Gather\n" in printed + "\n" and "  head: Gemm\n" in printed + "\n"
    assert "shared by" not in printed


def test_an_int8_copy_using_less_than_half_its_range_is_not_the_same_table(tmp_path):
    """Codes that use at most a third of the int8 range (a scale 3 x too coarse) quantize the table
    to fewer bits: not a second copy of it, though every value rounds to its code."""
    table = rng.standard_normal((512, 128)).astype(np.float32)
    q, scale = _int8_rows(table)
    coarse_scale = 3 * scale
    coarse = np.rint(table / coarse_scale[:, None]).astype(np.int8)  # codes up to 42 of 127
    path = tmp_path / "coarse.safetensors"
    save_file({"t0": table, "t1": coarse, "t1_scale": coarse_scale, "t2": q, "t2_scale": scale}, str(path))
    assert _groups(inspect_path(path)) == [("same values after dequantization", ("t0", "t2", "t2_scale"))]


def test_dequantize_linear_without_an_axis_scales_columns(tmp_path):
    """ONNX's DequantizeLinear defaults to axis 1: a [512, 256] code matrix with 256 scales is
    dequantized per column, not in runs of 512 consecutive values, so a table that equals the codes
    times run-wise scales is not its copy."""
    q = rng.integers(-127, 128, (512, 256)).astype(np.int8)
    scale = rng.uniform(0.01, 0.02, 256).astype(np.float32)
    runs = (q.reshape(-1).astype(np.float32) * np.repeat(scale, 512)).reshape(512, 256)  # not the node's output
    nodes = [helper.make_node("DequantizeLinear", ["head_q", "head_scale"], ["head"]),
             helper.make_node("Gemm", ["x", "head"], ["y"], transB=1),
             helper.make_node("Identity", ["runs"], ["z"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 256])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "z")],
        [numpy_helper.from_array(q, "head_q"), numpy_helper.from_array(scale, "head_scale"),
         numpy_helper.from_array(runs, "runs")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    assert _groups(inspect_path(path)) == []


@pytest.mark.parametrize("cols", [slice(None), slice(1, 3)], ids=["whole rows", "part of each row"])
def test_a_block_read_past_the_end_of_a_cut_file_names_the_file_and_tensor(tmp_path, cols):
    # review-found: a short read gave numpy's "cannot reshape" instead of the format error the other readers give
    from gemma_export.errors import FormatError
    from gemma_export.inspect import TensorEntry, read_block

    path = tmp_path / "cut.bin"
    path.write_bytes(np.arange(4, dtype=np.float32).tobytes())  # 4 of the 4 x 4 values
    entry = TensorEntry(name="table", shape=(4, 4), dtype="F32", nbytes=64, elements=16, path=path, offset=0,
                        item_dtype=np.dtype(np.float32))
    assert read_block(entry, slice(0, 1), cols).tolist() == [[0.0, 1.0, 2.0, 3.0][cols]]
    with pytest.raises(FormatError, match=f"^{path}: tensor 'table' ends past the end of the file$"):
        read_block(entry, slice(0, 4), cols)


def test_packed_4_bit_codes_count_two_weights_per_byte(tiny_dir, tmp_path):
    # the fp32-equivalent size counts weights: an int4 export's uint8 codes hold two per byte (it
    # showed half the model's size before)
    import math

    from gemma_export.sources import open_source

    weights = sum(math.prod(t.shape) for t in open_source(tiny_dir).tensors.values() if len(t.shape) == 2)
    totals = {}
    for dtype in ("int8", "int4"):
        out = export(tiny_dir, tmp_path / dtype, dtype, block_size=16).out_dir
        result = CliRunner().invoke(app, ["inspect", str(out), "--json"])
        assert result.exit_code == 0, result.output
        totals[dtype] = json.loads(result.stdout)["total_elements"]
    assert weights < totals["int4"] < 1.2 * weights and weights < totals["int8"] < 1.2 * weights, (weights, totals)


def test_an_int8_table_one_step_off_somewhere_is_not_the_same_table(tmp_path):
    """Codes within half a step of the float table everywhere match it; a copy of a slightly
    different table (one value moved by 0.8 of its row's step before rounding) does not."""
    table = rng.standard_normal((512, 128)).astype(np.float32)
    q, scale = _int8_rows(table)
    moved = table.copy()
    step = 0.8 * scale[7] * np.where(table[7] < 0, 1, -1)  # towards zero: the row's scale stays
    # a value whose code the move changes (one that sits 0.3-0.5 of a step past a level would keep it)
    col = next(j for j in range(128) if np.rint((table[7, j] + step[j]) / scale[7]) != np.rint(table[7, j] / scale[7]))
    moved[7, col] += step[col]
    q_moved, scale_moved = _int8_rows(moved)
    assert np.array_equal(scale_moved, scale) and (q_moved != q).sum() == 1
    path = tmp_path / "two.safetensors"
    save_file({"t0": table, "t1": q_moved, "t1_scale": scale_moved, "t2": q, "t2_scale": scale}, str(path))
    assert _groups(inspect_path(path)) == [("same values after dequantization", ("t0", "t2", "t2_scale"))]


@pytest.mark.parametrize("nbytes, found", [(64 << 10, True), ((64 << 10) - 4, False)])
def test_duplicates_are_searched_from_64_kib_on(tmp_path, nbytes, found):
    from gemma_export.inspect import MIN_DUPLICATE_BYTES

    assert MIN_DUPLICATE_BYTES == 64 << 10
    values = rng.standard_normal(nbytes // 4).astype(np.float32)
    path = tmp_path / "small.safetensors"
    save_file({"a": values, "b": values.copy()}, str(path))
    assert _groups(inspect_path(path)) == ([("identical bytes", ("a", "b"))] if found else [])


def test_a_transformers_folder_is_inspected_as_its_weights_sharded_or_not(tmp_path):
    """A FunctionGemma helper's note: `inspect` refused a transformers folder ("is a folder") and a
    sharded one's index ("not an ONNX, safetensors ..."); only a single shard could be read."""
    from conftest import make_tiny_model

    model = make_tiny_model(vocab_size=400)  # a 102 kB table: duplicates are looked for from 64 KiB
    single = tmp_path / "single"
    model.save_pretrained(single)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="120KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    whole = inspect_path(single)
    assert whole.path == str(single / "model.safetensors") and whole.format == "safetensors"
    for given in (sharded, sharded / "model.safetensors.index.json"):
        report = inspect_path(given)
        assert report.path == str(sharded / "model.safetensors.index.json") and report.format == "safetensors"
        assert sorted((t.name, t.shape) for t in report.tensors) == sorted((t.name, t.shape) for t in whole.tensors)
        assert report.total_bytes == whole.total_bytes and report.duplicates == whole.duplicates == []
    # the same values stored twice, in two shards: found across them
    table = index["weight_map"]["model.embed_tokens.weight"]
    other = next(v for v in index["weight_map"].values() if v != table)
    from safetensors.numpy import load_file

    copy = load_file(str(sharded / other))
    copy["lm_head.weight"] = load_file(str(sharded / table))["model.embed_tokens.weight"]
    save_file(copy, str(sharded / other))
    index["weight_map"]["lm_head.weight"] = other
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    (group,) = inspect_path(sharded).duplicates
    assert sorted(group.names) == ["lm_head.weight", "model.embed_tokens.weight"]
    result = CliRunner().invoke(app, ["inspect", str(sharded)])
    assert result.exit_code == 0 and "one table stored 2 times" in result.output, result.output


def test_a_negative_top_is_refused_by_the_api_as_by_the_command(tiny_int8_export):
    """A review: only the command line checked --top; format_report(report, -1) and to_dict(-1)
    listed every tensor but the smallest (a [:-1] slice)."""
    from gemma_export.errors import ConfigError
    from gemma_export.inspect import format_report, inspect_path

    report = inspect_path(tiny_int8_export)
    for call in (lambda: format_report(report, -1), lambda: report.to_dict(-1)):
        with pytest.raises(ConfigError, match=r"^--top -1: expected 0 or more$"):
            call()
    assert report.to_dict(0)["largest"] == []
    assert not any(line.endswith("%") for line in format_report(report, 0).splitlines())  # no tensor rows
    assert sum(line.endswith("%") for line in format_report(report, 2).splitlines()) == 2


def test_a_pre_packed_copy_says_what_its_data_file_holds_beyond_the_graphs_tensors(tiny_int8_export, tmp_path):
    """A tester: `inspect EXPORT/prepacked` gave the tensors' 168 MB for a 369 MB data file without
    a word about onnxruntime's packed weights."""
    import shutil

    from gemma_export.prepack import prepack

    folder = tmp_path / "copy"
    shutil.copytree(tiny_int8_export, folder)
    prepack(folder)
    report = inspect_path(folder / "prepacked")
    data = (folder / "prepacked" / "model.onnx.data").stat().st_size
    stored = sum(t.nbytes for t in report.tensors if t.path is not None)
    assert data > stored and report.note == (
        f"a pre-packed copy: model.onnx.data also holds about {data - stored:,} bytes of onnxruntime's packed weights "
        "for this machine, which the graph lists as no tensor (inspect the export itself for its weights)")
    shown = CliRunner().invoke(app, ["inspect", str(folder / "prepacked"), "--top", "0"]).stdout
    assert f"note: {report.note}" in shown and "consumers of the largest 0" not in shown
    assert inspect_path(folder).note == "" and report.to_dict(0)["note"] == report.note
