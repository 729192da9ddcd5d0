"""Rebuild a Gemma tokenizer (``tokenizer.json``) from a GGUF's ``tokenizer.ggml.*`` metadata, so
that ``generate`` works from a GGUF alone.

Gemma's SentencePiece model is BPE with byte fallback. A GGUF carries the pieces, their scores and
types, but no merges; the merges are recovered from the vocabulary: every way of cutting a piece
into two pieces that are themselves in the vocabulary is a merge, ranked by the merged piece's
position in the file (Gemma's merge order follows the token order, not the scores). Pieces made of
spaces are stored as real spaces and renamed to ``▁`` runs, the spelling the normalizer produces.
Pipeline (normalizer, pre-tokenizer, decoder) as transformers' ``GemmaTokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from .errors import FormatError
from .text_files import TOKENIZER_FILE_BYTES, check_size

SPACE = "\u2581"  # SentencePiece's visible space
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def read_tokenizer_json(path: Path, content: bytes | None = None) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` in ``tokenizer.json`` at ``path`` (``content``: its bytes, when
    already read).

    Parsing Gemma's file (262,144 pieces, 514,906 merges) takes ~300 MB of heap for ~100 MB of
    tokenizer (2026-12-05, tokenizers 0.23); the rest is given back to the kernel before returning
    (:func:`~gemma_export.memory.release_free_heap`), so a session created next does not start on
    top of it: it cut the peak of ``gemma-export generate`` on the real int8 export from 796 to
    642 MB. Read from the file itself (not from ``content``), the parse needs ~70 MB less.

    Raises:
        FormatError: ``"{path}: not a readable tokenizer (...)"``: not UTF-8, or not a tokenizer the
            ``tokenizers`` library reads; or (read from ``path``) larger than
            :data:`~gemma_export.text_files.TOKENIZER_FILE_BYTES`.
    """
    from .memory import release_free_heap

    tokenizer = None
    if content is None:  # read by the tokenizers library, whole, at ~3 x its size in heap: bounded first
        check_size(path, path.stat().st_size, "a tokenizer file", TOKENIZER_FILE_BYTES)
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception:  # any failure (bad bytes, a path Rust cannot take): read it below for the message
            pass
    if tokenizer is None:
        try:
            text = (path.read_bytes() if content is None else content).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(f"{path}: not a readable tokenizer (not UTF-8: byte {exc.start})") from None
        try:
            tokenizer = Tokenizer.from_str(text)
        except Exception as exc:  # the tokenizers library raises a bare Exception on a malformed file
            raise FormatError(f"{path}: not a readable tokenizer ({str(exc)[:120]})") from None
        del text
    release_free_heap()
    return tokenizer


def check_tokenizer_vocab(tokenizer: Tokenizer, vocab_size: int, path: Path) -> None:
    """Refuse a tokenizer whose own vocabulary (its model's pieces; added tokens are not counted)
    holds an id the model's table has no row for.

    Raises:
        ConfigError: ``"{path}: token id N ('piece') is outside the model's vocab_size V; ..."``.
    """
    from .errors import ConfigError

    vocab = tokenizer.get_vocab(with_added_tokens=False)
    if not vocab:
        return
    piece, top = max(vocab.items(), key=lambda item: item[1])
    if top >= vocab_size:
        raise ConfigError(f"{path}: token id {top:,} ({piece!r}) is outside the model's vocab_size {vocab_size:,} "
                          f"(ids 0 to {vocab_size - 1:,}); the tokenizer does not belong to these weights")


def _merges(pieces: Sequence[str]) -> list[tuple[str, str]]:
    rank = {piece: index for index, piece in enumerate(pieces)}
    found: list[tuple[int, int, int, str, str]] = []
    for merged_rank, piece in enumerate(pieces):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            left_rank, right_rank = rank.get(left), rank.get(right)
            if left_rank is not None and right_rank is not None:
                found.append((merged_rank, left_rank, right_rank, left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def tokenizer_from_gguf(
    tokens: Sequence[str],
    token_types: Sequence[int],
    bos_token_id: int,
    unk_token_id: int,
    add_bos_token: bool = True,
) -> Tokenizer:
    """Build a ``tokenizers.Tokenizer`` equivalent to transformers' Gemma tokenizer.

    Args:
        tokens: ``tokenizer.ggml.tokens``, one piece per id.
        token_types: ``tokenizer.ggml.token_type`` (3 = control, 4 = user defined).
        bos_token_id, unk_token_id: from ``tokenizer.ggml.bos_token_id`` / ``unknown_token_id``
            (the end-of-turn ids are the config's: no tokenizer behaviour depends on them).
        add_bos_token: prepend ``<bos>`` when encoding (``tokenizer.ggml.add_bos_token``).
    """
    pieces = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    tokenizer = Tokenizer(
        BPE(vocab=vocab, merges=_merges(pieces), unk_token=pieces[unk_token_id], fuse_unk=True, byte_fallback=True)
    )
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([
        AddedToken(p, normalized=False, special=True)
        for p, t in zip(pieces, token_types) if t == TOKEN_TYPE_CONTROL
    ])
    tokenizer.add_tokens([
        AddedToken(p, normalized=False, special=False)
        for p, t in zip(pieces, token_types) if t == TOKEN_TYPE_USER_DEFINED
    ])
    if add_bos_token:
        bos = pieces[bos_token_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_token_id)]
        )
    return tokenizer


def tokenizer_config_json(tokens: Sequence[str], bos_token_id: int, eos_token_id: int, pad_token_id: int,
                          unk_token_id: int, add_bos_token: bool) -> str:
    """A minimal ``tokenizer_config.json`` naming the special tokens (read by transformers and genai)."""
    return json.dumps({
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": tokens[bos_token_id],
        "eos_token": tokens[eos_token_id],
        "pad_token": tokens[pad_token_id],
        "unk_token": tokens[unk_token_id],
        "add_bos_token": bool(add_bos_token),
        "add_eos_token": False,
    }, indent=2, sort_keys=True)
