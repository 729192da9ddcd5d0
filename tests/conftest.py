"""Shared fixtures: tiny random Gemma 3 checkpoints written by transformers, and their references."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# tools/ holds the reference-format fixture generator (tools/jax_reference.py) the tests share
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

try:
    import torch
    import transformers
except ImportError as exc:  # a one-line usage error, not a traceback from every test module
    raise pytest.UsageError(f"the tests need the [test] extra ({exc}): pip install -e '.[test]'") from None


def broken_copy(tiny_dir: Path, src: Path, edit_config=None, edit_tensors=None) -> Path:
    """A copy of a transformers folder at ``src`` with ``config.json`` (a dict, edited in place) or
    the tensors of ``model.safetensors`` (a name → array dict, edited in place) changed."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(tiny_dir, src)
    if edit_config:
        config = json.loads((src / "config.json").read_text())
        edit_config(config)
        (src / "config.json").write_text(json.dumps(config))
    if edit_tensors:
        tensors = load_file(str(src / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(src / "model.safetensors"))
    return src


def tiny_config(**overrides):
    """A small Gemma 3 text config with mixed layer types and a short sliding window."""
    kwargs = dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=6, max_position_embeddings=256, rms_norm_eps=1e-6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
        attn_implementation="eager",
    )
    kwargs.update(overrides)
    return transformers.Gemma3TextConfig(**kwargs)


def make_tiny_model(seed: int = 0, **overrides):
    """A Gemma3ForCausalLM with random weights, norms included (so 1 + w matters)."""
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(tiny_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.15)
    return model


def save_tiny(model, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def tiny_model():
    return make_tiny_model()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tiny_model) -> Path:
    return save_tiny(tiny_model, tmp_path_factory.mktemp("tiny_hf"))


def reference_logits(model, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    """transformers eager logits for every position, float32 [B, S, V]."""
    with torch.no_grad():
        ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64))
        mask = None if attention_mask is None else torch.from_numpy(np.asarray(attention_mask, dtype=np.int64))
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float().numpy()


def write_char_tokenizer(folder: Path, vocab_size: int = 96) -> Path:
    """A character-level ``tokenizer.json`` whose ids fit a tiny vocabulary: 0 <pad>, 1 <eos>,
    2 <bos> (prepended), 3 <unk>, then lower-case letters, digits and punctuation."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors

    chars = "abcdefghijklmnopqrstuvwxyz0123456789 .,;:'\"()-\n"
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({c: 4 + i for i, c in enumerate(chars[: vocab_size - 4])})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="session")
def tiny_int8_export(tiny_dir, tmp_path_factory) -> Path:
    """An int8 export of the tiny model with a character-level tokenizer (for generate/bench/bundle)."""
    import shutil

    from gemma_export.exporter import export

    src = tmp_path_factory.mktemp("tiny_tok_src")
    shutil.copytree(tiny_dir, src, dirs_exist_ok=True)
    write_char_tokenizer(src)
    return export(src, tmp_path_factory.mktemp("tiny_int8") / "int8", "int8", block_size=16).out_dir


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """A plain-text file the character-level tokenizer covers (~1,000 characters)."""
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("the quick brown fox jumps over the lazy dog; many hands make light work. " * 14)
    return path


@pytest.fixture
def encoded_lengths(monkeypatch) -> list[int]:
    """The lengths (characters) of every text ``tokenizers.Tokenizer.encode`` is given during the
    test, in order: a prompt refused for its length must be tokenized only a prefix at a time."""
    from tokenizers import Tokenizer

    lengths: list[int] = []
    encode = Tokenizer.encode

    def recording(self, sequence, *args, **kwargs):
        lengths.append(len(sequence))
        return encode(self, sequence, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", recording)
    return lengths


def export_with_config(export: Path, dest: Path, **config) -> Path:
    """A copy of ``export`` at ``dest`` whose manifest's ``config`` has the given fields changed (the
    graph is untouched): how a hand-edited manifest is made in the tests."""
    import json
    import shutil

    shutil.copytree(export, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["config"].update(config)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


def undeletable(path: Path) -> bool:
    """Make the file ``path`` impossible to delete (immutable as root, a read-only folder otherwise);
    False when this machine does not allow it."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            return False
    else:
        path.parent.chmod(0o500)
    try:
        path.unlink()
    except OSError:
        return True
    return False


def deletable(path: Path) -> None:
    """Undo :func:`undeletable`."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    else:
        path.parent.chmod(0o700)


def refuse_listing(monkeypatch, folder: Path) -> None:
    """Make ``Path.iterdir`` of ``folder`` (and of no other path) raise PermissionError, as listing
    a folder without read permission does for a user other than root (who reads every folder)."""
    listing = Path.iterdir

    def refused(self):
        if self == folder:
            raise PermissionError(13, "Permission denied", str(self))
        return listing(self)

    monkeypatch.setattr(Path, "iterdir", refused)
