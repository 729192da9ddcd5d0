"""The board team's reference export: StableHLO MLIR text + a flat 1-D safetensors archive.

Format (the board team's StableHLO/IREE export, as they describe it): every weight is a module-level global bound to an
external parameter, in trace order::

    util.global private @t0 = #flow.parameter.named<"model"::"t0"> : tensor<262153x640xbf16>

The archive stores each key flat (``[count]``); the shape exists only in the MLIR. bf16 globals hold
bf16 values; int8 globals ``tN : tensor<RxCxi8>`` come with ``tN_scale : tensor<Rxf32>`` (per-row
symmetric). Norm weights already hold ``1 + w`` (llama.cpp's convention). The archive also carries
trace-baked constants (RoPE tables ``[seq, head_dim / 2]``, sliding-window masks ``[seq, seq]``) and,
in older exports, the tied table a second time for the LM head.

There is no name map: :func:`map_globals` assigns globals to Gemma weights by trace order (the
tracer's ids, else the order the program first loads them, :func:`_trace_order`) and shape
(embedding first; per layer the slots in forward order, each shape filled in order; final norm; an
optional LM head) and confirms the map with values where it can (norm gains near 1, a second table
equal to the first).

The MLIR carries no configuration: the shapes give vocabulary, hidden size, layers, head_dim, heads and
intermediate size; the rest follows Gemma 3 (global layers ``i % 6 == 5``, window 512, RoPE bases
10,000 / 1,000,000, ``query_pre_attn_scalar = head_dim``, eps 1e-6), as for GGUF sources.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np

from quant.bf16 import bfloat16_bits_to_float32
from quant.rows import first_non_finite

from ..checkpoint import (EMBED, FINAL_NORM, LM_HEAD, Checkpoint, TensorRef, layer_shapes, resolve_lm_head,
                          validate_tensors)
from ..config import DEFAULT_ROPE_THETA, GEMMA3_270M_SLIDING_WINDOW, GemmaConfig, RopeParameters, gemma3_layer_types
from ..errors import FormatError, NumericError, SourceNotFoundError
from ..text_files import require_file
from .safetensors_header import DTYPE_BYTES, NUMPY_DTYPES, looks_like_safetensors, read_header


#: MLIR element type → the safetensors dtype its archive stores (sizes and numpy types:
#: ``safetensors_header.DTYPE_BYTES`` / ``NUMPY_DTYPES``)
ELEMENT_TYPES = {"bf16": "BF16", "f32": "F32", "f16": "F16", "i8": "I8", "i32": "I32"}
MAX_LINE_BYTES = 1 << 20
#: the largest reference MLIR file read: the 270M's is 0.4 MB, its weights being parameters in the archive
MAX_MLIR_BYTES = 256 << 20

_GLOBAL = re.compile(
    r'^\s*util\.global\s+(?:private\s+|public\s+)?(?:mutable\s+)?@([\w$.-]+)\s*=\s*'
    r'#flow\.parameter\.named<"([^"]*)"::"([^"]*)">\s*:\s*tensor<([^>]*)>')
_FUNC = re.compile(r'^\s*func\.func\s+(public\s+|private\s+)?@([\w$.-]+)\s*\((.*?)\)\s*(?:->\s*(.*?))?\s*(?:attributes\b.*)?\{?\s*$')
_TENSOR = re.compile(r"tensor<([^>]*)>")
_LOAD = re.compile(rb"util\.global\.load\s+(?:immutable\s+)?@([\w$.-]+)")
_STRING_LITERAL = re.compile(rb'"(?:[^"\\]|\\.)*"')


@dataclasses.dataclass(frozen=True)
class MlirGlobal:
    """One ``util.global`` bound to an external parameter."""

    name: str
    scope: str
    key: str
    shape: tuple[int, ...]
    element_type: str
    line: int

    @property
    def count(self) -> int:
        """Elements the declared shape holds."""
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class MlirFunction:
    """A function's signature: argument and result tensor types as written (e.g. ``1x24xi32``), and
    whether it can be called from outside the module (MLIR's default; ``private`` cannot)."""

    name: str
    arguments: tuple[str, ...]
    results: tuple[str, ...]
    line: int
    public: bool = True


@dataclasses.dataclass(frozen=True)
class MlirModule:
    """What :func:`parse_mlir` read: the parameter globals in file order, the functions (public and
    private), and the line of each global's first ``util.global.load`` (the order the traced program
    uses them)."""

    path: Path
    globals: tuple[MlirGlobal, ...]
    functions: tuple[MlirFunction, ...]
    first_loads: dict[str, int] = dataclasses.field(default_factory=dict)
    #: per function (None: outside any, e.g. an initializer), the globals in the order it first loads them
    function_loads: dict[str | None, tuple[str, ...]] = dataclasses.field(default_factory=dict)


#: the most elements one declared tensor may have (2**40: far above any Gemma table, far below int64)
MAX_ELEMENTS = 1 << 40


def _tensor_type(text: str, where: str) -> tuple[tuple[int, ...], str]:
    parts = text.strip().split("x")
    element = parts[-1]
    if element not in ELEMENT_TYPES:
        raise FormatError(f"{where}: element type {element!r} in tensor<{text}> is not one of {', '.join(ELEMENT_TYPES)}")
    dims = []
    for p in parts[:-1]:
        if not (p.isascii() and p.isdigit()) or int(p) == 0:  # int() also reads other scripts' digits
            raise FormatError(f"{where}: dimension {p!r} in tensor<{text}> is not a static size > 0")
        dims.append(int(p))
    if math.prod(dims) > MAX_ELEMENTS:  # Python integers: no int64 wrap-around before this check
        raise FormatError(f"{where}: tensor<{text[:80]}> has {math.prod(dims):.3g} elements, more than the "
                          f"{MAX_ELEMENTS:.3g} any archive of this model can hold")
    return tuple(dims), element


def parse_mlir(path: str | Path) -> MlirModule:
    """Read the globals and public function signatures of a reference MLIR file, line by line
    (the files are large; no MLIR parser is loaded).

    Raises:
        SourceNotFoundError: no such file.
        FormatError: a safetensors archive given instead, a file over :data:`MAX_MLIR_BYTES` or a
            line over 1 MiB, a byte-order mark or a NUL byte (which IREE refuses), bytes that are not
            UTF-8 outside strings and comments, a global with a
            dynamic or unknown tensor type, a global declared twice, no global at all, or braces
            that do not balance (a file cut short, or more closed than opened).
    """
    path = require_file(path, "reference MLIR file")
    if (size := path.stat().st_size) > MAX_MLIR_BYTES:  # the IREE run reads it whole
        raise FormatError(f"{path}: {size:,} bytes; expected reference MLIR text of at most {MAX_MLIR_BYTES:,} "
                          "(its weights live in the archive beside it)")
    with open(path, "rb") as f:
        if path.suffix == ".safetensors" or looks_like_safetensors(f.read(9)):
            raise FormatError(f"{path}: a safetensors archive, not reference MLIR text; give the export's .mlir file "
                              "(its archive is read from beside it)")
    globals_: list[MlirGlobal] = []
    functions: list[MlirFunction] = []
    seen: set[str] = set()
    loads: dict[str, int] = {}  # global name -> line of its first util.global.load
    in_function: dict[str | None, dict[str, None]] = {}  # function -> the globals it loads, first load first
    function = None  # the function the lines belong to (a module's functions are not nested)
    depth = 0  # braces open (regions, attribute dictionaries): a whole module closes them all
    last = b""  # the last line of code (comments aside): a whole file ends with a '}'
    with open(path, "rb") as f:
        number = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):  # a longer line is never read whole
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                raise FormatError(f"{path}:{number}: a line of more than 1 MiB; not reference MLIR text")
            # what IREE's parser refuses is refused here too, before an export or a measurement
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raise FormatError(f"{path}: starts with a UTF-8 byte-order mark, which IREE's MLIR parser refuses; "
                                  "remove its first 3 bytes")
            if b"\0" in raw:
                raise FormatError(f"{path}:{number}: holds a NUL byte (column {raw.index(bytes(1)) + 1}); not MLIR text")
            code = _STRING_LITERAL.sub(b'""', raw).split(b"//", 1)[0]  # braces in strings and comments do not count
            try:  # MLIR's own text (strings and comments aside) is UTF-8: random bytes read as a brace closed too many
                code.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise FormatError(f"{path}:{number}: not UTF-8 text (byte {exc.start + 1} of the line's code); not "
                                  "reference MLIR text") from None
            depth += code.count(b"{") - code.count(b"}")
            if code.strip():
                last = code.strip()
            if depth < 0:
                raise FormatError(f"{path}:{number}: closes a brace that was not opened; not reference MLIR text")
            if b"util.global" not in raw and b"func.func" not in raw and b"util.initializer" not in raw:
                continue
            load = _LOAD.search(code)  # not one in a comment or a string
            if load:
                loaded = load.group(1).decode("utf-8", "replace")
                loads.setdefault(loaded, number)
                in_function.setdefault(function, {}).setdefault(loaded, None)
                continue
            if re.match(rb"\s*util\.initializer\b", code):
                function = None
                continue
            line = raw.decode("utf-8", errors="replace")
            where = f"{path}:{number}"
            m = _GLOBAL.match(line)
            if m:
                name, scope, key, ttype = m.groups()
                if scope != "model":
                    raise FormatError(f"{where}: global @{name} is bound to scope {scope!r}, expected 'model'")
                if name in seen:
                    raise FormatError(f"{where}: global @{name} declared twice")
                seen.add(name)
                shape, element = _tensor_type(ttype, where)
                globals_.append(MlirGlobal(name, scope, key, shape, element, number))
                continue
            if re.match(r"\s*util\.global\s", line) and "parameter.named" in line:  # #flow. or #stream.
                # a parameter global in a form this reader does not know: named here, not later as
                # "archive key without util.global"
                raise FormatError(f"{where}: cannot read this util.global; expected `util.global private @tN = "
                                  f'#flow.parameter.named<"model"::"tN"> : tensor<...>`, found {line.strip()[:120]!r}')
            m = _FUNC.match(line)
            if m:
                visibility, name, args, results = m.groups()
                function = name
                functions.append(MlirFunction(name, tuple(_TENSOR.findall(args)), tuple(_TENSOR.findall(results or "")),
                                              number, (visibility or "").strip() != "private"))
    if not globals_:
        kind = "" if Path(path).suffix.lower() == ".mlir" else " (a reference export is its .mlir file, with its archive beside it)"
        raise FormatError(f"{path}: no util.global bound to a #flow.parameter.named parameter; not a reference "
                          f"export{kind}")
    if depth:
        raise FormatError(f"{path}: ends with {depth} brace(s) still open; the file is cut short")
    if not last.endswith(b"}"):  # a file without a module around its operations, cut between two of them
        raise FormatError(f"{path}: ends with {last.decode('utf-8', 'replace')[-60:]!r}, not a '}}' closing a module "
                          "or function; the file is cut short")
    return MlirModule(path, tuple(globals_), tuple(functions), loads,
                      {f: tuple(names) for f, names in in_function.items()})


def find_archive(mlir_path: Path) -> Path:
    """The safetensors archive of a reference MLIR: ``<stem>.safetensors`` or ``gemma.safetensors``
    beside it.

    Raises:
        SourceNotFoundError: neither exists.
    """
    candidates = list(dict.fromkeys((mlir_path.with_suffix(".safetensors"), mlir_path.parent / "gemma.safetensors")))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    for candidate in candidates:
        if candidate.exists():
            require_file(candidate, "reference archive (safetensors)")
    raise SourceNotFoundError(f"{mlir_path}: no archive beside it (expected {' or '.join(c.name for c in candidates)})")


class Archive:
    """The flat safetensors archive, checked against the MLIR declarations before any data is read.

    Raises:
        SourceNotFoundError: ``path`` is missing or not a regular file.
        FormatError: the archive's header is malformed, lacks a key a global is bound to, holds keys
            no global declares, or gives a tensor another dtype or byte count than its declaration.
    """

    def __init__(self, module: MlirModule, path: Path):
        self.path = require_file(path, "reference archive (safetensors)")
        # the names first: a key missing from the header is named, not the gap its bytes leave
        entries = {e.name: e for e in read_header(path, layout=False)}
        declared = {g.key: g for g in module.globals}
        missing = [g for g in module.globals if g.key not in entries]
        if missing:
            g = missing[0]
            raise FormatError(f"{module.path}:{g.line}: global @{g.name} is bound to key '{g.key}', which {path} lacks")
        extra = sorted(set(entries) - set(declared))
        if extra:
            raise FormatError(f"{path}: key '{extra[0]}' has no util.global in {module.path.name}")
        for g in module.globals:
            e = entries[g.key]
            st_dtype = ELEMENT_TYPES[g.element_type]
            width = DTYPE_BYTES[st_dtype]
            if e.dtype != st_dtype or e.nbytes != g.count * width:
                raise FormatError(f"{path}: key '{g.key}' holds {e.dtype} {list(e.shape)} ({e.nbytes:,} bytes); "
                                  f"{module.path.name}:{g.line} declares tensor<{'x'.join(map(str, g.shape))}x"
                                  f"{g.element_type}> ({g.count * width:,} bytes of {st_dtype})")
        read_header(path)  # then the layout: the tensors tile the data section
        self.entries = entries

    def raw(self, g: MlirGlobal, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The global's values in its stored type (bf16 as uint16 bit patterns, i8 as int8, f32 as
        float32), reshaped to the declared shape; ``rows`` = ``(start, stop)`` of the first axis gives
        ``[stop - start, *shape[1:]]`` read from the file alone."""
        entry = self.entries[g.key]
        st_dtype = ELEMENT_TYPES[g.element_type]
        np_dtype, width = NUMPY_DTYPES[st_dtype], DTYPE_BYTES[st_dtype]
        row_elems = g.count // g.shape[0] if g.shape else 1
        start, stop = rows if rows is not None else (0, g.shape[0] if g.shape else 1)
        data = np.memmap(self.path, dtype=np_dtype, mode="r", offset=entry.offset + start * row_elems * width,
                         shape=((stop - start) * row_elems,))
        shape = ((stop - start), *g.shape[1:]) if g.shape else ()
        return np.asarray(data).reshape(shape)


def _to_float(raw: np.ndarray, element_type: str) -> np.ndarray:
    if element_type == "bf16":
        return bfloat16_bits_to_float32(raw.view(np.uint16))
    return raw.astype(np.float32)


@dataclasses.dataclass
class _Slot:
    name: str
    shape: tuple[int, ...]


#: one layer's tensors in the order a trace of the forward loads them (q/k norms right after v,
#: before the attention's output projection)
_LAYER_TRACE_ORDER = (
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.o_proj.weight",
    "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "mlp.down_proj.weight", "post_feedforward_layernorm.weight",
)


def _layer_slots(i: int, h: int, heads: int, kv: int, d: int, inter: int) -> list[_Slot]:
    shapes = layer_shapes(h, heads, kv, d, inter)
    return [_Slot(f"model.layers.{i}.{name}", shapes[name]) for name in _LAYER_TRACE_ORDER]


@dataclasses.dataclass(frozen=True)
class GlobalMap:
    """What :func:`map_globals` decided: transformers name → global (int8 scales found by name),
    the globals skipped as trace-baked constants, and whether a second table was collapsed."""

    weights: dict[str, MlirGlobal]
    scales: dict[str, MlirGlobal]  # global name -> its ``_scale`` companion (int8 archives)
    skipped: tuple[MlirGlobal, ...]
    duplicate_table: MlirGlobal | None
    config: GemmaConfig
    unused: tuple[MlirGlobal, ...] = ()  # declared, never loaded by the program: not part of the model


def _trace_order(found: list[MlirGlobal], first_loads: dict[str, int]) -> list[MlirGlobal]:
    """The globals in trace order, whatever order the file declares them in: the order of the
    tracer's ids ``tN`` (reference-format: sparse and in trace order) of the archive keys, else of
    the names, when every global has one (:func:`_ordered_by_ids`); else the order in which the
    program first loads them (``util.global.load``; a file's line order, which helper functions or
    initializers can break) when it loads every one; else the file's."""
    if (ordered := _ordered_by_ids(found)) is not None:
        return ordered
    if found and all(g.name in first_loads for g in found):
        return sorted(found, key=lambda g: first_loads[g.name])
    return found


def _ordered_by_ids(found: list[MlirGlobal]) -> list[MlirGlobal] | None:
    """``found`` sorted by the tracer's ids of the archive keys, else of the names; None when some
    global has none."""
    for ids in ([_trace_id(g.key) for g in found], [_trace_id(g.name) for g in found]):
        if all(n is not None for n in ids):
            return [g for _, g in sorted(zip(ids, found), key=lambda pair: pair[0])]
    return None


def _check_load_order(weights: list[MlirGlobal], function_loads: dict[str | None, tuple[str, ...]], where: Path) -> None:
    """A function that loads every one of ``weights`` (the traced program) must first load them in
    the order given (the tracer's ids'): otherwise the ids put one weight where the program uses
    another, and an export would be another model than the one IREE runs. Where constants (RoPE
    tables, masks) are loaded does not matter, and a function that loads only some weights (a
    helper) gives no order to compare.

    Raises:
        FormatError: naming the function, the weight it loads and the one the ids put there.
    """
    names = {g.name for g in weights}
    for function, loaded in function_loads.items():
        program = [name for name in loaded if name in names]
        if len(program) != len(weights):
            continue
        for i, (g, name) in enumerate(zip(weights, program)):
            if g.name != name:
                used = next(x for x in weights if x.name == name)
                raise FormatError(f"{where}: {'@' + function if function else 'an initializer'} loads @{name} (key "
                                  f"'{used.key}') where the tracer's ids put @{g.name} (key '{g.key}'), weight {i} in "
                                  "trace order; the ids and the program disagree, so the weights cannot be mapped")


def _trace_id(name: str) -> int | None:
    """N of a tracer's global name ``tN`` (reference-format: the ids are sparse and in trace order),
    else None."""
    m = re.fullmatch(r"t(\d+)", name)
    return int(m.group(1)) if m else None


def map_globals(module: MlirModule) -> GlobalMap:
    """Assign the globals to Gemma 3 weights by trace order (:func:`_trace_order`) and shape (see
    the module docstring);
    :func:`read_reference` then confirms the map with values (every norm gain must look like 1 + w).

    Raises:
        FormatError: the first global is not a ``[vocab, hidden]`` table, an int8 weight has no
            ``_scale`` (or scales have no global), or the globals do not fill whole layers (names the
            global and what was found).
        ConfigError: the sizes read from the shapes make no valid Gemma 3 config (e.g. heads not a
            multiple of KV heads).
    """
    where = module.path
    by_name = {g.name: g for g in module.globals}
    scales = {g.name[: -len("_scale")]: g for g in module.globals if g.name.endswith("_scale") and g.name[: -len("_scale")] in by_name}
    for base, sg in scales.items():
        owner = by_name[base]
        if owner.element_type != "i8":
            raise FormatError(f"{where}:{sg.line}: @{sg.name} names @{base} as its int8 weight, but @{base} is "
                              f"tensor<{'x'.join(map(str, owner.shape))}x{owner.element_type}>; only i8 globals have "
                              "per-row _scale globals")
        if sg.element_type != "f32" or sg.shape != owner.shape[:1]:
            raise FormatError(f"{where}:{sg.line}: @{sg.name} is tensor<{'x'.join(map(str, sg.shape))}x{sg.element_type}>; "
                              f"expected per-row f32 scales tensor<{owner.shape[0]}xf32> of an i8 @{base}")
    # refused here, before any weight is read: scales without an owner (which would otherwise be
    # mapped as a weight and shift every later slot); an int8 weight without scales, below
    for g in module.globals:
        if g.name.endswith("_scale") and g.name[: -len("_scale")] not in by_name:
            raise FormatError(f"{where}:{g.line}: @{g.name} names no global @{g.name[: -len('_scale')]}; expected "
                              "the per-row scales of an int8 global")
    weights_and_constants = [g for g in module.globals if g not in scales.values()]
    # a global the program never loads is not part of the model IREE runs (when the program's loads
    # were found at all): left out, as IREE leaves it out, rather than mapped to a weight
    unused = [g for g in weights_and_constants if g.name not in module.first_loads] if module.first_loads else []
    order = _trace_order([g for g in weights_and_constants if g not in unused], module.first_loads)
    if not order or len(order[0].shape) != 2:
        raise FormatError(f"{where}: the first global is not a [vocab, hidden] table (found "
                          f"{list(order[0].shape) if order else 'none'}); not a Gemma reference export")
    vocab, hidden = order[0].shape
    # head_dim: the first 1-D global that is not hidden-sized (q_norm); heads and KV heads: rows of
    # the first two [*, hidden] projections (q, k), whose rows are whole heads (a baked [S, S] mask
    # with S = hidden is not, unless hidden is a multiple of head_dim); intermediate size: columns of
    # the first [hidden, *] global whose columns are neither hidden nor heads x head_dim (down_proj).
    d = next((g.shape[0] for g in order[1:] if len(g.shape) == 1 and g.shape[0] != hidden), None)
    two_d = [g for g in order[1:] if len(g.shape) == 2 and g.shape[1] == hidden and g.shape[0] != vocab
             and d and g.shape[0] % d == 0]
    if d is None or len(two_d) < 2:
        raise FormatError(f"{where}: cannot find per-head norms and projections among {len(order)} globals")
    heads, kv = two_d[0].shape[0] // d, two_d[1].shape[0] // d
    down = next((g for g in order[1:] if len(g.shape) == 2 and g.shape[0] == hidden
                 and g.shape[1] not in (hidden, heads * d, d // 2)), None)  # d // 2: a RoPE table of `hidden` positions
    inter = down.shape[1] if down is not None else None
    if inter is None:
        raise FormatError(f"{where}: cannot find a down projection [hidden, intermediate] among the globals")

    weights: dict[str, MlirGlobal] = {EMBED: order[0]}
    skipped: list[MlirGlobal] = []
    duplicate = None
    layer = 0
    slots = _layer_slots(layer, hidden, heads, kv, d, inter)
    final_norm = None
    def is_constant(g: MlirGlobal) -> bool:  # RoPE tables [seq, head_dim/2] and masks [seq, seq]
        return len(g.shape) == 2 and g.shape[1] in (d // 2, g.shape[0]) or len(g.shape) == 4 and g.shape[-1] == g.shape[-2]

    rest = order[1:]
    for index, g in enumerate(rest):
        starts_layer = not any(s.name in weights for s in slots)
        if starts_layer and g.shape == (hidden,) and final_norm is None:
            # a hidden-sized norm where a layer would start: the final norm if only a table (the
            # LM head) or constants follow
            following = [x for x in rest[index + 1:] if not is_constant(x)]
            if all(x.shape == (vocab, hidden) for x in following) and len(following) <= 1:
                final_norm = g
                weights[FINAL_NORM] = g
                continue
        free = [s for s in slots if s.name not in weights and s.shape == g.shape]
        if free and final_norm is None:
            weights[free[0].name] = g
            if all(s.name in weights for s in slots):
                layer += 1
                slots = _layer_slots(layer, hidden, heads, kv, d, inter)
            continue
        if g.shape == (vocab, hidden) and final_norm is not None and duplicate is None:
            duplicate = g
            continue
        if is_constant(g):
            skipped.append(g)
            continue
        # the sizes came from the first globals' shapes: one declared wrong there shows up here, later
        raise FormatError(f"{where}:{g.line}: global @{g.name} tensor<{'x'.join(map(str, g.shape))}> fits no Gemma 3 "
                          f"weight after {len(weights)} mapped ({layer} whole layers); the sizes were read from the "
                          f"first globals' shapes (hidden {hidden} from @{order[0].name}, {heads} heads and {kv} KV "
                          f"heads of {d} from @{two_d[0].name} and @{two_d[1].name}, intermediate {inter} from "
                          f"@{down.name}), so check those declarations too")
    if _ordered_by_ids(order) is not None:  # the ids gave the order: the program must use the weights so
        mapped = {g.name for g in [*weights.values(), *([duplicate] if duplicate is not None else [])]}
        _check_load_order([g for g in order if g.name in mapped], module.function_loads, where)
    partial = [s.name for s in slots if s.name in weights]
    if partial or final_norm is None or layer == 0:
        raise FormatError(f"{where}: globals end inside layer {layer} or without a final norm "
                          f"({layer} whole layers mapped)")
    # rms_norm_eps, max_position_embeddings: Gemma 3 270M's and FunctionGemma's config.json values
    config = GemmaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layer,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=d, rms_norm_eps=1e-6,
        sliding_window=GEMMA3_270M_SLIDING_WINDOW,  # the MLIR carries no config; its baked masks use this window
        layer_types=gemma3_layer_types(layer),
        rope_parameters={kind: RopeParameters(theta) for kind, theta in DEFAULT_ROPE_THETA.items()},
        query_pre_attn_scalar=float(d), max_position_embeddings=32768,
        eos_token_id=GemmaConfig.default_eos_token_ids(vocab))
    config.validate(str(where))
    # an int8 weight cannot be read without its scales (an int8 constant the export skips may lack them)
    for g in [*weights.values(), *([duplicate] if duplicate is not None else [])]:
        if g.element_type == "i8" and g.name not in scales:
            raise FormatError(f"{where}:{g.line}: int8 global @{g.name} has no @{g.name}_scale (expected per-row f32 "
                              f"scales tensor<{g.shape[0] if g.shape else '?'}xf32>)")
    return GlobalMap(weights, scales, tuple(skipped), duplicate, config, tuple(unused))


#: the largest per-row scale of an int8 weight whose codes (|code| <= 128) times it stay finite in float32
_MAX_INT8_SCALE = float(np.finfo(np.float32).max) / 128


def read_reference(mlir_path: str | Path, archive_path: str | Path | None = None) -> Checkpoint:
    """Open a reference export as a :class:`Checkpoint` (norm gains converted to ``w``, int8
    dequantized per row, a duplicated table collapsed when its values equal the first).

    Raises:
        SourceNotFoundError: the MLIR or its archive is missing.
        FormatError: any mismatch between MLIR, archive and the Gemma layout (named).
        ConfigError: as :func:`map_globals`.
        NumericError: a norm gain or an int8 weight's scales hold NaN or Inf (named with the index).
    """
    mlir_path = Path(mlir_path)
    module = parse_mlir(mlir_path)
    archive = Archive(module, Path(archive_path) if archive_path else find_archive(mlir_path))
    mapped = map_globals(module)

    def values(g: MlirGlobal, rows=None) -> np.ndarray:
        raw = archive.raw(g, rows)
        if g.element_type == "i8":  # map_globals checked that every int8 weight has its scales
            scale_g = mapped.scales[g.name]
            scale = archive.raw(scale_g)
            scale = scale[rows[0]:rows[1]] if rows else scale
            if (bad := first_non_finite(scale)) is not None:  # named as the scales', not the codes'
                raise NumericError(f"{archive.path}:{scale_g.key}: @{scale_g.name} holds {scale[bad]} at row "
                                   f"{(rows[0] if rows else 0) + bad[0]}; scales must be finite")
            # a per-row scale is max |w| / 127: never negative (it would flip the row's sign), and
            # small enough that an int8 code (|code| <= 128) times it stays finite in float32
            if (wrong := np.flatnonzero((scale < 0) | (scale > _MAX_INT8_SCALE))).size:
                row = int(wrong[0])
                raise NumericError(f"{archive.path}:{scale_g.key}: @{scale_g.name} holds {scale.ravel()[row]:.6g} at row "
                                   f"{(rows[0] if rows else 0) + row}; expected a scale from 0 to {_MAX_INT8_SCALE:.4g} "
                                   "(an int8 row's max |w| / 127, whose codes times it stay finite in float32)")
            out = raw.astype(np.float32)
            out *= scale.reshape(-1, *([1] * (raw.ndim - 1)))  # in place: one float32 copy, not two
            return out
        return _to_float(raw, g.element_type)

    norms = {n for n in mapped.weights if n.endswith("norm.weight")}
    tensors: dict[str, TensorRef] = {}
    for name, g in mapped.weights.items():
        origin = f"{archive.path}:{g.key}"
        if name in norms:
            gain = values(g)
            tensors[name] = TensorRef(name, g.shape, origin, lambda gain=gain: gain - 1.0)
            tensors[name].check_finite(gain)  # a NaN is named as such, not as the trace order
            if not np.median(gain) > 0.05:
                raise FormatError(f"{origin}: mapped to '{name}' but its median {np.median(gain):.3g} is not a "
                                  "positive norm gain (1 + w); the trace order is not the expected one")
        else:
            tensors[name] = TensorRef(name, g.shape, origin, lambda g=g: values(g),
                                      row_reader=(lambda a, b, g=g: values(g, (a, b))) if len(g.shape) == 2 else None)
    if mapped.duplicate_table is not None:
        g = mapped.duplicate_table
        tensors[LM_HEAD] = TensorRef(LM_HEAD, g.shape, f"{archive.path}:{g.key}", lambda: values(g),
                                     row_reader=lambda a, b: values(g, (a, b)))
    config = mapped.config
    validate_tensors(config, tensors, str(mlir_path))
    resolve_lm_head(config, tensors, str(mlir_path))  # an equal second table is collapsed
    identity = {"kind": "reference-mlir", "path": str(mlir_path.resolve()), "archive": str(archive.path.resolve()),
                "bytes": mlir_path.stat().st_size + archive.path.stat().st_size,
                "globals": len(module.globals), "skipped_constants": len(mapped.skipped),
                "unused_globals": len(mapped.unused),
                "duplicate_table_collapsed": mapped.duplicate_table is not None and LM_HEAD not in tensors}
    return Checkpoint(config=config, tensors=tensors, tokenizer=None, identity=identity, path=mlir_path,
                      files=(mlir_path, archive.path))
