"""Greedy generation from an export with plain onnxruntime, tokenizers and numpy, without this
toolkit: the I/O contract of ``docs/integration.md`` as code, for a board application to copy.

Usage:
    python tools/plain_onnxruntime.py --model gemma-3-270m-onnx-int8 --prompt "The capital of France is"
    python tools/plain_onnxruntime.py --model DIR --prompt-file long.txt --max-new-tokens 40 --mode arrays --json -

Two ways to carry the KV cache (``--mode``):

* ``shared`` (default): one float32 buffer per ``past_key_values.{i}.key|value``, bound with IO
  binding as both that input and its ``present.{i}.*`` output; GroupQueryAttention writes each step
  after the rows held. The sliding layers' buffers hold ``sliding_window - 1`` rows plus room
  (:data:`SLIDING_ROOM`); when a step would not fit, the rows that left the window are dropped and
  the graph's ``sliding_cache_start`` says which position the first row holds. This is the schedule
  ``gemma-export generate`` follows, so the tokens and logits are the same as its own.
* ``arrays``: plain ``session.run``, each ``present.*`` fed back as the next ``past_key_values.*``.
  Every layer then keeps every position (no sliding-window saving), and the logits equal
  ``generate``'s up to float rounding (an int8 export's 8-bit activations can turn that into a
  different token at a near-tie).

Prints the text (prompt and continuation); with ``--json FILE`` it also writes the ids as a golden
entry ``{"prompt", "prompt_ids", "expected_ids", "prefill_chunk"}`` (four of the keys ``gemma-export generate
--json`` writes, all that ``gemma-export parity --model DIR --golden FILE`` needs to check them
against the toolkit); with ``--json -`` it prints that entry instead of the text.
One prompt at a time (batch 1). Needs only ``onnxruntime``, ``tokenizers`` and ``numpy``.
"""
from __future__ import annotations

import argparse
import errno
import json
import mmap
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

# onnxruntime 1.29+ on Linux uploads usage telemetry and keeps a device id and an event cache in
# ~/.cache/Microsoft unless this is set before it is imported; a value set by the user is kept
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

#: rows a sliding layer's buffer keeps beyond its window - 1 (one drop per this many decode steps)
SLIDING_ROOM = 64
#: the longest prompt step, as ``gemma-export generate`` (int8 logits move with the step's length)
PREFILL_CHUNK = 512


def _give_back_free_heap() -> None:
    """glibc's ``malloc_trim(0)``: freed heap pages go back to the kernel. Elsewhere (musl, macOS)
    there is no such function and nothing is done."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


class Model:
    """An export folder: its onnxruntime session, tokenizer and the config its manifest records."""

    def __init__(self, folder: str | Path, threads: int | None = None, prepacked: bool = False):
        import onnxruntime as ort
        from tokenizers import Tokenizer

        folder = Path(folder)
        if not folder.is_dir():
            found = "no such folder" if not folder.exists() else "a file"
            raise FolderError(f"{folder}: {found}; expected an export folder of gemma-export (model.onnx, "
                              "tokenizer.json, manifest.json)")
        if not (folder / "manifest.json").exists():  # another tool's folder, e.g. genai's
            if (folder / "BUNDLE.json").is_file() and (folder / "model" / "manifest.json").is_file():
                raise FolderError(f"{folder}: a board folder of gemma-export bundle; its export is {folder / 'model'} "
                                  "(give that)")
            raise FolderError(f"{folder}: no manifest.json; not an export folder of gemma-export")
        manifest = _read_manifest(folder / "manifest.json")
        config = _config(manifest, folder / "manifest.json")
        # the pre-packed copy (`gemma-export prepack`) holds the same graph with this CPU's packed weights
        graph = folder / "prepacked" / "model.onnx" if prepacked else folder / "model.onnx"
        if prepacked and not graph.is_file():
            raise FolderError(f"{graph}: no pre-packed copy; `gemma-export prepack --model {folder}` makes one on "
                              "this machine (or leave out --prepacked)")
        for needed in (graph, folder / "tokenizer.json"):  # named here: the libraries' errors leave the name out
            if not needed.is_file():
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(needed))
        if not prepacked:
            _check_graph(folder, manifest)
        # the tokenizer first, then the heap its parse freed handed back to the kernel: glibc keeps
        # it otherwise, and the session's memory lands on top of it. Real int8 export, maximum
        # resident memory (2026-12-06): 663.7 MB, against 734.8 MB without the trim and 914.8 MB
        # with the tokenizer loaded after the session; from the pre-packed copy 840 MB, against
        # 1,036 MB without the trim (the copy's weights are mapped: nothing reuses that freed heap)
        try:
            self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
            raise FolderError(f"{folder / 'tokenizer.json'}: not a tokenizer the tokenizers library reads "
                              f"({(str(e).strip().splitlines() or [type(e).__name__])[0]})") from None
        _give_back_free_heap()
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: the load's expected sliding_cache_start warning stays quiet
        # no memory patterns: onnxruntime keeps one per set of input shapes for the session's life, and
        # each decode step's attention_mask is one longer: 3.4 KB of heap a token (docs/integration.md)
        options.enable_mem_pattern = False
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        self.layers = config["num_hidden_layers"]
        self.kv_shape = (config["num_key_value_heads"], config["head_dim"])
        eos = config["eos_token_id"]  # one id or a list of them
        self.bos, self.stop = config["bos_token_id"], {eos} if isinstance(eos, int) else set(eos)
        self.max_positions = config.get("max_position_embeddings")
        # graphs that keep the sliding layers' windows only have this optional input (default 0)
        names = {i.name for i in self.session.get_overridable_initializers()}
        sliding = "sliding_cache_start" in names
        self.sliding = {i for i, kind in enumerate(config["layer_types"]) if kind == "sliding_attention"} if sliding else set()
        self.window = config["sliding_window"]
        cache = {i.name: i.shape for i in self.session.get_inputs() if i.name.startswith("past_key_values.")}
        expected = {f"past_key_values.{i}.{kind}" for i in range(self.layers) for kind in ("key", "value")}
        if set(cache) != expected:  # a hand-edited manifest, or another graph
            raise FolderError(f"{folder / 'manifest.json'}: field 'config.num_hidden_layers' is {self.layers}, but "
                              f"{graph} has {len(cache) // 2} layers' past_key_values inputs")
        shape = cache["past_key_values.0.key"]
        dims = shape if len(shape) == 4 else [None] * 4  # [batch, kv heads, positions, head_dim]; [] when undeclared
        for field, size, dim in (("num_key_value_heads", self.kv_shape[0], dims[1]), ("head_dim", self.kv_shape[1], dims[3])):
            if isinstance(dim, int) and dim != size:
                raise FolderError(f"{folder / 'manifest.json'}: field 'config.{field}' is {size}, but {graph}'s "
                                  f"past_key_values.0.key has {dim}")
        # what the graph was built with (gemma-export records it in the graph's metadata): a manifest
        # edited by hand changed the sliding schedule, and so the tokens, without a word
        built = self.session.get_modelmeta().custom_metadata_map
        recorded = built.get("gemma_export.sliding_window")
        if recorded is not None and recorded != str(self.window):
            raise FolderError(f"{folder / 'manifest.json'}: field 'config.sliding_window' is {self.window}, but "
                              f"{graph} was built with {recorded}")
        layers = built.get("gemma_export.sliding_layers")
        if sliding and layers is not None and layers != ",".join(map(str, sorted(self.sliding))):
            raise FolderError(f"{folder / 'manifest.json'}: field 'config.layer_types' makes layers "
                              f"{sorted(self.sliding)} sliding, but {graph} was built with sliding layers {layers}")
        vocab = self.session.get_outputs()[0].shape[-1]  # logits: [batch, positions, vocabulary]
        for field, ids in (("bos_token_id", {self.bos}), ("eos_token_id", self.stop)):
            if isinstance(vocab, int) and max(ids) >= vocab:  # the lookup would fail in onnxruntime, mid-run
                raise FolderError(f"{folder / 'manifest.json'}: field 'config.{field}' holds {max(ids)}, outside "
                                  f"{graph}'s vocabulary of {vocab} ids")

    def encode(self, text: str) -> list[int]:
        """The prompt's ids with exactly one ``<bos>`` first (tokenizer.json adds it; text that
        starts with "<bos>" would otherwise get two)."""
        ids = self.tokenizer.encode(text).ids
        if ids[:2] == [self.bos, self.bos]:  # the text's own <bos> after the added one: keep one of those two
            ids = ids[1:]
        return ids if ids[:1] == [self.bos] else [self.bos, *ids]

    def empty_cache(self) -> dict[str, np.ndarray]:
        heads, head_dim = self.kv_shape
        return {f"past_key_values.{i}.{kind}": np.zeros((1, heads, 0, head_dim), np.float32)
                for i in range(self.layers) for kind in ("key", "value")}


#: the manifest's config fields this script reads
CONFIG_FIELDS = ("num_hidden_layers", "num_key_value_heads", "head_dim", "bos_token_id", "eos_token_id",
                 "layer_types", "sliding_window")


class FolderError(ValueError):
    """A file of the export folder that this script cannot use; the message starts with its path."""


class ManifestError(FolderError):
    """An export's manifest.json that this script cannot use; the message starts with its path."""


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: what each field of :data:`CONFIG_FIELDS` must hold, as a check and its description
CONFIG_KINDS = {
    "num_hidden_layers": (_is_count, "an integer >= 1"), "num_key_value_heads": (_is_count, "an integer >= 1"),
    "head_dim": (_is_count, "an integer >= 1"), "sliding_window": (_is_count, "an integer >= 1"),
    "bos_token_id": (_is_id, "a token id (integer >= 0)"),
    "eos_token_id": (lambda v: _is_id(v) or (isinstance(v, list) and v != [] and all(map(_is_id, v))),
                     "a token id or a non-empty list of them"),
    "layer_types": (lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v), "a list of strings"),
}


def _read_manifest(path: Path):
    """The parsed JSON of an export's manifest.json (read once: :func:`_config` and
    :func:`_check_graph` take it).

    Raises:
        FileNotFoundError: no manifest. ManifestError: "<path>: unreadable manifest: ...".
    """
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path}: unreadable manifest: {e}") from None


def _config(manifest, path: Path) -> dict:
    """The ``config`` object of an export's parsed manifest.json (:func:`_read_manifest`; ``path``
    names it in messages), with :data:`CONFIG_FIELDS`.

    Raises:
        ManifestError: "<path>: ..." naming what is wrong.
    """
    config = manifest.get("config") if isinstance(manifest, dict) else None
    if not isinstance(config, dict):
        raise ManifestError(f"{path}: no 'config' object; is this an export folder?")
    missing = [name for name in CONFIG_FIELDS if name not in config]
    if missing:
        raise ManifestError(f"{path}: field 'config.{missing[0]}' is missing")
    for name in CONFIG_FIELDS:
        check, kind = CONFIG_KINDS[name]
        if not check(config[name]):
            raise ManifestError(f"{path}: field 'config.{name}' must be {kind}, found {json.dumps(config[name])[:60]}")
    limit = config.get("max_position_embeddings")
    if limit is not None and not _is_count(limit):
        raise ManifestError(f"{path}: field 'config.max_position_embeddings' must be an integer >= 1 (or absent), "
                            f"found {json.dumps(limit)[:60]}")
    if len(config["layer_types"]) != config["num_hidden_layers"]:
        raise ManifestError(f"{path}: field 'config.layer_types' has {len(config['layer_types'])} entries, "
                            f"'config.num_hidden_layers' is {config['num_hidden_layers']}")
    return config


def steps(prompt_ids: list[int], max_new_tokens: int, chunk: int, step_fn, stop: set[int]) -> list[int]:
    """Greedy decoding: the prompt in steps of ``chunk`` tokens, then one token per step, each
    step given ``attention_mask`` ones ``[1, past + n]`` and ``position_ids`` ``past … past + n - 1``.
    Stops after a stop id (kept in the result) or ``max_new_tokens``."""
    new_ids, feed, past = [], list(prompt_ids), 0
    while len(new_ids) < max_new_tokens:
        for first in range(0, len(feed), chunk):
            part = np.asarray([feed[first:first + chunk]], np.int64)
            end = past + part.shape[1]
            logits = step_fn(part, np.ones((1, end), np.int64), np.arange(past, end, dtype=np.int64)[None], past)
            past = end
        new_ids.append(int(np.argmax(logits[0, -1])))  # ties: the lowest id
        if new_ids[-1] in stop:
            break
        feed = new_ids[-1:]
    return new_ids


def arrays_step(model: Model):
    """A step function that feeds each ``present.*`` back as the next ``past_key_values.*``."""
    cache = model.empty_cache()
    outputs = [o.name for o in model.session.get_outputs()]

    def step(input_ids, attention_mask, position_ids, past):
        result = dict(zip(outputs, model.session.run(None, {"input_ids": input_ids, "attention_mask": attention_mask,
                                                             "position_ids": position_ids, **cache})))
        cache.update({name: result[name.replace("past_key_values.", "present.", 1)] for name in cache})
        return result["logits"]

    return step


def shared_step(model: Model, capacity: int, max_step: int):
    """A step function over one buffer per cache tensor, bound as both past and present.

    ``capacity``: the most positions any step holds (prompt + new tokens - 1); ``max_step``: the
    prompt's step length (``--chunk``, 512 as ``generate``'s, also for a shorter prompt), which sizes
    the sliding layers' buffers (``sliding_window - 1 + max(max_step, SLIDING_ROOM)`` rows, at most
    ``capacity``) and so decides when rows are dropped."""
    import onnxruntime as ort

    binding = model.session.io_binding()
    binding.bind_output("logits")  # bound first: get_outputs() lists outputs in the order they were bound
    arrays: dict[str, np.ndarray] = {}
    state = {"start": 0, "start_value": None}

    def rows_for(step_len: int) -> int:
        return min(capacity, model.window - 1 + max(step_len, SLIDING_ROOM))

    def bind(name: str, rows: int) -> np.ndarray:
        # a private anonymous map of its own: a replaced buffer, and the cache after the generation,
        # go back to the kernel when freed (a heap array may stay in glibc's heap; a shared map,
        # mmap's default, would be shmem, outside the process's Anonymous memory)
        count = model.kv_shape[0] * rows * model.kv_shape[1]
        private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
        array = np.frombuffer(mmap.mmap(-1, count * 4, **private), np.float32, count).reshape(
            1, model.kv_shape[0], rows, model.kv_shape[1])
        value = ort.OrtValue.ortvalue_from_numpy(array)  # wraps the array's memory
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(name.replace("past_key_values.", "present.", 1), value)
        arrays[name] = array  # keep it alive while bound
        return array

    sliding = [f"past_key_values.{i}.{kind}" for i in sorted(model.sliding) for kind in ("key", "value")]
    for i in range(model.layers):
        for kind in ("key", "value"):
            bind(f"past_key_values.{i}.{kind}", rows_for(max_step) if i in model.sliding else capacity)

    def step(input_ids, attention_mask, position_ids, past):
        seq = input_ids.shape[1]
        if sliding:
            held = past - state["start"]  # rows the sliding buffers hold: positions start … past - 1
            if held + seq > arrays[sliding[0]].shape[2] or held > model.window - 1 + SLIDING_ROOM:
                keep, rows = min(held, model.window - 1), rows_for(seq)
                for name in sliding:  # the last window - 1 rows move to the front
                    kept = arrays[name][:, :, held - keep:held].copy()
                    target = arrays[name] if arrays[name].shape[2] == rows else bind(name, rows)
                    target[:, :, :keep] = kept
                state["start"] = past - keep
            state["start_value"] = np.asarray(state["start"], np.int64)  # an initializer: OrtValue binding only
            binding.bind_ortvalue_input("sliding_cache_start", ort.OrtValue.ortvalue_from_numpy(state["start_value"]))
        binding.bind_cpu_input("input_ids", input_ids)
        binding.bind_cpu_input("attention_mask", attention_mask)
        binding.bind_cpu_input("position_ids", position_ids)
        # bound again each step: an --all-logits graph's logits are [1, seq, V], and onnxruntime
        # refused the prompt's [1, 16, V] buffer for a decode step's [1, 1, V]
        binding.bind_output("logits")
        model.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy().copy()  # onnxruntime reuses its output memory

    return step


def generate(model: Model, prompt_ids: list[int], max_new_tokens: int, mode: str = "shared",
             chunk: int = PREFILL_CHUNK) -> list[int]:
    """Greedy new ids for ``prompt_ids`` (``mode``: "shared" or "arrays", as the module says)."""
    if mode == "arrays":
        return steps(prompt_ids, max_new_tokens, chunk, arrays_step(model), model.stop)
    capacity = len(prompt_ids) + max(max_new_tokens - 1, 0)
    return steps(prompt_ids, max_new_tokens, chunk, shared_step(model, capacity, chunk), model.stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an export folder (model.onnx, tokenizer.json, manifest.json)")
    text = parser.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="text to continue")
    text.add_argument("--prompt-file", type=Path, help="a UTF-8 file whose text to continue (all of it, "
                      "trailing newlines and CRLF too, a leading byte-order mark dropped; `--prompt \"$(cat FILE)\"` "
                      "drops trailing newlines)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most (1 or more; default 32)")
    parser.add_argument("--mode", choices=("shared", "arrays"), default="shared",
                        help="the KV cache: one buffer per tensor shared by past and present (default), or "
                             "arrays fed back")
    parser.add_argument("--chunk", type=int, default=PREFILL_CHUNK,
                        help=f"longest prompt step, in tokens (1 or more; default {PREFILL_CHUNK}, as generate's)")
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (1 to 4 x the CPUs; default: one per core)")
    parser.add_argument("--prepacked", action="store_true",
                        help="load prepacked/model.onnx, the copy `gemma-export prepack` made on this machine")
    parser.add_argument("--json", help="write the ids as a golden entry ({prompt, prompt_ids, expected_ids, prefill_chunk}, "
                        "for `gemma-export parity --golden`) to this new or earlier-written file ('-': print it instead of "
                        "the text)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.chunk < 1:
        parser.error("--max-new-tokens and --chunk must be at least 1")
    most_threads = 4 * (os.cpu_count() or 1)  # far more threads than CPUs: onnxruntime seemed to hang
    if args.threads is not None and not 1 <= args.threads <= most_threads:
        parser.error(f"--threads must be 1 to {most_threads} (4 x this machine's CPUs), found {args.threads}")

    def fail(where, error: Exception) -> int:
        if isinstance(error, OSError) and error.filename:
            where = error.filename  # the file that is missing, not the folder given
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error).strip()
        line = reason.splitlines()[0] if reason else type(error).__name__
        print(f"error: {line}" if where is None else f"error: {where}: {line}", file=sys.stderr)
        return 2  # bad input, as the toolkit's commands and the other tools

    if args.model == "":
        parser.error("--model: empty; give an export folder")
    if args.prompt_file is not None and str(args.prompt_file) in ("", "."):
        parser.error("--prompt-file: empty (or '.', a folder); give a text file")
    if args.json == "":
        parser.error("--json: empty; give a file name, or '-' for standard output")
    if args.json and args.json != "-":  # before the run: a path that cannot take the ids costs nothing
        out = Path(args.json)
        if not out.parent.is_dir():
            return fail(args.json, NotADirectoryError(f"folder {out.parent} does not exist"))
        if out.is_dir():
            return fail(args.json, IsADirectoryError("is a folder; expected a file to write the ids to"))
        prompt_file = args.prompt_file
        if prompt_file is not None and (out.resolve() == prompt_file.resolve() or _same_file(out, prompt_file)):
            return fail(args.json, ValueError("is the --prompt-file; write the ids elsewhere"))
        enclosing = _inside_export(out)
        if enclosing is not None:
            return fail(args.json, ValueError(f"inside {enclosing}, an output of gemma-export whose listing would no "
                                              "longer name every file in it; write the ids elsewhere"))
        if out.exists():  # an earlier record, replaced in place: it opens for writing (opened to append, not changed)
            if not _earlier_record(out):
                return fail(args.json, FileExistsError("exists and is not a record this script wrote; not replaced"))
            try:
                open(out, "ab").close()
            except OSError as e:
                return fail(args.json, OSError(e.errno, f"cannot be written ({e.strerror})"))
        else:
            try:  # the folder takes new files (/proc and /sys do not, whatever their files' sizes say)
                handle, probe = tempfile.mkstemp(prefix=".plain-", dir=out.parent)
                os.close(handle)
                os.unlink(probe)
            except OSError as e:
                return fail(args.json, OSError(e.errno, f"cannot write in {out.parent} ({e.strerror})"))
    try:
        # bytes, not read_text: its universal newlines would turn a file's CRLF into "\n"; a leading
        # byte-order mark (Windows editors write one) is not text: both as `gemma-export generate --prompt-file`
        prompt = (args.prompt if args.prompt is not None else
                  args.prompt_file.read_bytes().decode("utf-8").removeprefix("\ufeff"))
    except (OSError, UnicodeDecodeError) as e:
        return fail(args.prompt_file, e)
    try:
        model = Model(args.model, args.threads, args.prepacked)
    except FolderError as e:  # names the file itself
        return fail(None, e)
    except Exception as e:  # noqa: BLE001 - onnxruntime's and tokenizers' own error types
        return fail(args.model, e)
    prompt_ids = model.encode(prompt)
    positions = len(prompt_ids) + args.max_new_tokens - 1  # the last new token is never fed back
    if model.max_positions and positions > model.max_positions:
        return fail(args.model, ValueError(f"{len(prompt_ids)} prompt tokens and {args.max_new_tokens} new ones take "
                                           f"{positions} positions, more than the model's max_position_embeddings "
                                           f"{model.max_positions}"))
    new_ids = generate(model, prompt_ids, args.max_new_tokens, args.mode, args.chunk)
    # the prompt's text too, as `generate --json` writes it: `parity` names a failing entry by it
    record = json.dumps({"prompt": prompt, "prompt_ids": prompt_ids, "expected_ids": new_ids,
                         "prefill_chunk": args.chunk})
    if args.json and args.json != "-":
        try:
            Path(args.json).write_text(record + "\n")
        except OSError as e:
            return fail(args.json, e)
    if args.json == "-":
        print(record)
    else:
        # the text as `gemma-export generate` shows it: special tokens included, the stop id left out
        shown = new_ids[:-1] if new_ids and new_ids[-1] in model.stop else new_ids
        print(prompt + model.tokenizer.decode(shown, skip_special_tokens=False))
    return 0


def _check_graph(folder: Path, manifest: dict) -> None:
    """``folder/model.onnx`` is the graph ``manifest`` (the folder's parsed manifest.json) lists
    (size and sha256): a graph copied in from another export of the same model loads and runs,
    reading its own layout out of this folder's data file. The graph is small, so the hash costs
    nothing.

    Raises:
        FolderError: naming the graph and how it differs.
    """
    import hashlib

    manifest_path = folder / "manifest.json"
    tool = manifest.get("tool")
    if "files" not in manifest and isinstance(tool, dict) and "gemma-export" in tool:
        raise FolderError(f"{manifest_path}: written by gemma-export but lists no files; the folder changed after the "
                          "export (export it again)")
    try:
        listed = manifest.get("files", {})["model.onnx"]
        size, digest = listed["bytes"], listed["sha256"]
    except (KeyError, TypeError, AttributeError):  # another tool's manifest: nothing to compare
        return
    graph = folder / "model.onnx"
    found = graph.stat().st_size
    if found != size:
        raise FolderError(f"{graph}: {found:,} bytes, {manifest_path} records {size:,}; the folder changed after the "
                          "export (export it again; gemma-export verify checks every file)")
    if hashlib.sha256(graph.read_bytes()).hexdigest() != digest:
        raise FolderError(f"{graph}: sha256 differs from the one {manifest_path} records; the folder changed after "
                          "the export (export it again; gemma-export verify checks every file)")


def _inside_export(path: Path) -> Path | None:
    """The nearest folder above ``path`` that gemma-export wrote (an export: its manifest.json, a board
    folder: its BUNDLE.json, each listing the folder's files), or None: a file written there is one
    the listing lacks, and gemma-export verify then refuses the folder."""
    for parent in path.resolve().parents:
        for name, mark in (("manifest.json", "tool"), ("BUNDLE.json", "gemma_export_version")):
            listing = parent / name
            try:
                if not listing.is_file():  # not a FIFO either, whose read would wait for a writer
                    continue
                with open(listing, "rb") as f:
                    data = json.loads(f.read(1 << 20))
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and isinstance(data.get("files"), dict) and mark in data:
                return parent
    return None


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one file (a hard link too); False when either is missing."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _earlier_record(path: Path) -> bool:
    """Whether ``path`` holds a record ``--json`` wrote (or nothing), so that it may be replaced."""
    try:
        if path.is_file() and path.stat().st_size == 0:
            return True
        value = json.loads(path.read_bytes()[:1 << 20])
    except (OSError, ValueError):
        return False
    return isinstance(value, dict) and {"prompt_ids", "expected_ids"} <= set(value)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for it; the --json file is written last
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
