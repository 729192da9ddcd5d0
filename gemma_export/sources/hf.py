"""Read a transformers model folder: ``config.json``, ``model.safetensors`` or a sharded
``model.safetensors.index.json``, and the tokenizer files beside them.

Tensors stay memory-mapped (``safetensors.safe_open``) until the exporter asks for them. Names may
carry the multimodal prefix ``model.language_model.``, or none at all (a ``Gemma3TextModel``'s own
``embed_tokens.weight``, ``layers.{i}.…``, ``norm.weight``); vision-tower and projector tensors are
ignored. Any other tensor in the text decoder's names (e.g. a ``model.norm.bias``) is refused, since
leaving it out would change the model's output; a tensor of no known part is left out and noted
(:attr:`~gemma_export.checkpoint.Checkpoint.ignored`).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
from safetensors import SafetensorError, safe_open

from ..checkpoint import EMBED, FINAL_NORM, LM_HEAD, Checkpoint, Tokenizer, TensorRef, expected_shapes, resolve_lm_head, validate_tensors
from ..config import load_hf_config, with_generation_config
from ..errors import ConfigError, FormatError, reworded, shown
from ..text_files import SMALL_FILE_BYTES, TOKENIZER_FILE_BYTES, non_regular, read_bounded
from ..tokenizer import check_tokenizer_vocab, read_tokenizer_json
from .safetensors_header import read_header

# safe_open(framework="numpy") returns bf16 tensors (Gemma's published dtype) as numpy's bfloat16,
# a dtype numpy knows only once ml_dtypes is imported ("data type 'bfloat16' not understood")
BFLOAT16 = ml_dtypes.bfloat16

#: (transformers 5 saves a chat template to chat_template.jinja, not into tokenizer_config.json)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja")
#: the stop ids transformers' generate uses (:func:`~gemma_export.config.with_generation_config`)
GENERATION_CONFIG = "generation_config.json"
#: a transformers folder's weights: one file, or shards named by an index (:func:`shard_files`)
WEIGHTS_FILE, SHARD_INDEX = "model.safetensors", "model.safetensors.index.json"
#: tokenizer files copied as they are that must be JSON objects (tokenizer.json is parsed in full)
JSON_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def _check_json_object(path: Path, content: bytes) -> None:
    """Raises FormatError naming ``path`` (and the field) when ``content`` is not a UTF-8 JSON object,
    or a field that transformers' AutoTokenizer reads with a type (``bos_token``,
    ``extra_special_tokens``, ``added_tokens_decoder``, ...) has another."""
    try:
        value = json.loads(content.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise FormatError(f"{path}: expected UTF-8 JSON, found byte 0x{content[exc.start]:02x} at offset {exc.start}") from None
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{path}: expected a JSON object, found text that is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise FormatError(f"{path}: expected a JSON object, found {shown(value)}")
    # the special tokens transformers' AutoTokenizer reads with a type: a wrong one would pass the
    # export and verify, then raise TypeError in AutoTokenizer on the board (transformers 5.25)
    for name in _SIDE_FILE_TOKENS:
        if name in value and value[name] is not None and not _is_token(value[name]):
            raise FormatError(f"{path}: field '{name}' must be a token (a string, or an object whose 'content' is "
                              f"one), found {shown(value[name])}")
    for name in ("additional_special_tokens", "extra_special_tokens"):
        extra = value.get(name)
        tokens = list(extra.values()) if isinstance(extra, dict) else extra  # a dict: named tokens (transformers 5)
        if extra is not None and not (isinstance(tokens, list) and all(map(_is_token, tokens))):
            raise FormatError(f"{path}: field '{name}' must be a list (or an object) of tokens (strings, or objects "
                              f"whose 'content' is one), found {shown(extra)}")
    decoder = value.get("added_tokens_decoder")
    if decoder is not None and not (isinstance(decoder, dict) and all(
            key.isdigit() and isinstance(entry, dict) and isinstance(entry.get("content"), str)
            for key, entry in decoder.items())):
        raise FormatError(f"{path}: field 'added_tokens_decoder' must map token ids (\"0\", \"1\", ...) to objects "
                          f"whose 'content' is the token, found {shown(decoder)}")
    length = value.get("model_max_length")
    if length is not None and (isinstance(length, bool) or not isinstance(length, (int, float))):
        raise FormatError(f"{path}: field 'model_max_length' must be a number, found {shown(length)}")
    if value.get("tokenizer_class") is not None and not isinstance(value["tokenizer_class"], str):
        raise FormatError(f"{path}: field 'tokenizer_class' must be a class name (a string), found "
                          f"{shown(value['tokenizer_class'])}")


#: tokenizer side files' fields that transformers reads as special tokens
_SIDE_FILE_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token", "sep_token", "cls_token")


def _is_token(value) -> bool:
    """A special token as transformers writes one: its text, or an AddedToken object with ``content``."""
    return isinstance(value, str) or isinstance(value, dict) and isinstance(value.get("content"), str)
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
#: the decoder's own names in a checkpoint saved from transformers' ``Gemma3TextModel`` (no ``model.``
#: prefix and no head; transformers loads it into ``Gemma3ForCausalLM`` with the head tied)
_BARE = ("embed_tokens.", "layers.", "norm.")
#: a multimodal Gemma 3 checkpoint's parts besides the text decoder (transformers 4 and 5 names)
_OTHER_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _hf_name(key: str) -> str | None:
    """Map a checkpoint key to the text decoder's transformers name, or None when not ours."""
    if key in (LM_HEAD, "language_model." + LM_HEAD):
        return LM_HEAD
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return "model." + key[len(prefix):]
    if key.startswith(_BARE):
        return "model." + key
    return None


def shard_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a transformers folder and, for a sharded one, its index's
    ``weight_map`` (tensor name → shard file name; None for a single file).

    Raises:
        FormatError: an unreadable index, a shard that is not a file of the folder, or neither file.
    """
    single = folder / WEIGHTS_FILE
    index = folder / SHARD_INDEX
    if single.is_file():
        return [single], None
    if index.is_file():
        try:
            parsed = json.loads(read_bounded(index, "a shard index").decode("utf-8"))
            if not isinstance(parsed, dict):
                raise TypeError(f"expected a JSON object, found {shown(parsed)}")
            weight_map = parsed["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("expected an object mapping tensor names to shard file names")
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FormatError(f"{index}: cannot read 'weight_map': {exc}") from None
        files = []
        for name in names:
            shard = (folder / name)
            if Path(name).name != name or not shard.is_file():
                raise FormatError(f"{index}: shard '{name}' is not a file in {folder}")
            files.append(shard)
        return files, weight_map
    for path in (single, index):
        if (what := non_regular(path)) is not None:
            raise FormatError(f"{path}: is {what}; expected the weights (or the index of their shards)")
    raise FormatError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def _read(path: Path, key: str, get):
    """``get(opened file)`` for tensor ``key`` of ``path``, opened now (tensors are read lazily, while
    the export writes). A file deleted, truncated or rewritten since it was opened and checked is
    named as the source's problem (safetensors reports it without the file name, or as its own error).

    Raises:
        FormatError: naming the file and the tensor.
    """
    try:
        with safe_open(str(path), framework="numpy") as f:
            return get(f)
    except (OSError, SafetensorError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise FormatError(f"{path}: cannot read tensor '{key}' ({reason}); the file changed or went away after it "
                          "was opened: export again") from None


def _reader(path: Path, key: str):
    return lambda: _read(path, key, lambda f: f.get_tensor(key))


def _row_reader(path: Path, key: str):
    return lambda start, stop: _read(path, key, lambda f: f.get_slice(key)[start:stop])


def read_hf_folder(folder: Path, tokenizer: bool = True) -> Checkpoint:
    """Open a transformers Gemma 3 folder lazily; ``tokenizer`` False leaves its tokenizer files
    unread (the export was given another one).

    Raises:
        ConfigError: invalid ``config.json``.
        FormatError: unreadable safetensors, a duplicated, missing or misshapen tensor.
    """
    folder = Path(folder)
    # the stop ids transformers' generate uses: config.json's and generation_config.json's
    config = with_generation_config(load_hf_config(folder / "config.json"), folder / GENERATION_CONFIG)
    wanted = set(expected_shapes(config)) | {LM_HEAD}
    tensors: dict[str, TensorRef] = {}
    ignored: list[str] = []
    total_bytes = 0
    shards, weight_map = shard_files(folder)
    index = folder / SHARD_INDEX
    for shard in shards:
        total_bytes += shard.stat().st_size
        read_header(shard)  # named errors for a corrupt header before the library reads it
        try:
            with safe_open(str(shard), framework="numpy") as f:
                keys = list(f.keys())
                if weight_map is not None:  # the index and the shards must agree (transformers loads by the index)
                    for key in keys:
                        if weight_map.get(key) != shard.name:
                            where = f"maps it to '{weight_map[key]}'" if key in weight_map else "does not list it"
                            raise FormatError(f"{index}: tensor '{key}' is in {shard.name}, but the index {where}")
                    held = set(keys)
                    listed = sorted(k for k, v in weight_map.items() if v == shard.name and k not in held)
                    if listed:
                        raise FormatError(f"{index}: lists tensor '{listed[0]}' in {shard.name}, which does not hold it")
                for key in keys:
                    name = _hf_name(key)
                    if name not in wanted:
                        # other parts' tensors, and RoPE buffers some conversions saved (transformers
                        # recomputes them from rope_theta and ignores the saved ones, as the graph does)
                        if key.startswith(_OTHER_PARTS) or key.endswith("rotary_emb.inv_freq"):
                            continue
                        if name and name.startswith("model.layers."):
                            index = name.split(".")[2]
                            if index.isdigit() and int(index) >= config.num_hidden_layers:
                                raise FormatError(f"{shard}: unexpected tensor '{key}': the config has "
                                                  f"{config.num_hidden_layers} layers")
                            raise FormatError(f"{shard}: unexpected tensor '{key}': not a Gemma 3 decoder layer weight "
                                              "(expected self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, "
                                              "mlp.{gate,up,down}_proj and the four layer norms)")
                        if name is not None or key.startswith(("lm_head.", "language_model.lm_head.")):
                            raise FormatError(f"{shard}: unexpected tensor '{key}': not a weight of the Gemma 3 text "
                                              f"decoder (expected {EMBED}, {FINAL_NORM}, {LM_HEAD} and the layers'); "
                                              "leaving it out would change the model's output")
                        ignored.append(key)
                        continue
                    if name in tensors:
                        raise FormatError(f"{shard}: tensor '{name}' appears twice ('{key}' and {tensors[name].origin})")
                    view = f.get_slice(key)
                    if view.get_dtype() not in _FLOAT_DTYPES:
                        raise FormatError(f"{shard}: tensor '{key}' has dtype {view.get_dtype()}, expected one of "
                                          f"{', '.join(_FLOAT_DTYPES)}")
                    shape = tuple(int(x) for x in view.get_shape())
                    tensors[name] = TensorRef(name, shape, f"{shard}:{key}", _reader(shard, key),
                                              _row_reader(shard, key) if len(shape) == 2 else None)
        except FormatError:
            raise
        except Exception as exc:  # safetensors raises its own error types for a corrupt header
            raise FormatError(f"{shard}: not a readable safetensors file: {exc}") from None
    validate_tensors(config, tensors, str(folder))
    resolve_lm_head(config, tensors, str(folder))
    return Checkpoint(
        config=config,
        tensors=tensors,
        tokenizer=read_tokenizer_folder(folder, config.vocab_size) if tokenizer else None,
        identity={"kind": "hf", "path": str(folder.resolve()), "bytes": total_bytes},
        path=folder,
        ignored=tuple(ignored),
        files=(folder / "config.json", *[p for p in [folder / GENERATION_CONFIG] if p.is_file()], *shards),
    )



def read_tokenizer_folder(folder: Path, vocab_size: int | None, option: str | None = None) -> Tokenizer | None:
    """The tokenizer files of a transformers folder (:data:`TOKENIZER_FILES`, those present), checked
    as an export will use them: ``tokenizer.json`` parsed and (given ``vocab_size``) its ids within
    it, the side files JSON objects. None when the folder has no ``tokenizer.json``.

    Args:
        folder: the source folder, or the folder of ``--tokenizer``.
        vocab_size: the model's; None: checked later (:func:`~gemma_export.tokenizer.check_tokenizer_vocab`).
        option: the option that named the folder (``--tokenizer``), added to every message.

    Raises:
        FormatError: a tokenizer file that is a folder, link to nothing, FIFO or device; an unreadable
            or malformed one.
        ConfigError: a ``tokenizer.json`` whose ids exceed ``vocab_size`` (:func:`check_tokenizer_vocab`).
    """
    given = f" ({option})" if option else ""
    try:
        for name in TOKENIZER_FILES:  # one that is there but unreadable must not pass for absent (no tokenizer, no calibration)
            if (what := non_regular(folder / name)) is not None:
                kind = "the tokenizer file" if name == "tokenizer.json" else "a tokenizer side file"
                raise FormatError(f"{folder / name}: is {what}; expected {kind}{'' if option else ' or none'}")
        big = ("tokenizer.json", "tokenizer.model")  # the vocabulary itself; the side files are small JSON
        files = {n: read_bounded(folder / n, "a tokenizer file" if n in big else "a tokenizer side file",
                                 TOKENIZER_FILE_BYTES if n in big else SMALL_FILE_BYTES)
                 for n in TOKENIZER_FILES if (folder / n).is_file()}
        for name in JSON_SIDE_FILES:  # copied beside the export, where transformers and genai parse them
            if name in files:
                _check_json_object(folder / name, files[name])
        if "chat_template.jinja" in files:  # a template transformers reads as text
            try:
                files["chat_template.jinja"].decode("utf-8")
            except UnicodeDecodeError as exc:
                raise FormatError(f"{folder / 'chat_template.jinja'}: not UTF-8 text (byte {exc.start:,}); expected "
                                  "the model's chat template") from None
        if "tokenizer.json" not in files:
            return None
        # copied beside the export and used to calibrate: refused now, not after the slow work
        parsed = read_tokenizer_json(folder / "tokenizer.json", files["tokenizer.json"])
        if vocab_size is not None:
            check_tokenizer_vocab(parsed, vocab_size, folder / "tokenizer.json")
    except (FormatError, ConfigError) as exc:
        raise reworded(exc, f"{exc}{given}") from None
    return Tokenizer(lambda: files, parsed)
