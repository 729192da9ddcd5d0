"""``gemma-export bench``: latency and memory of an export under onnxruntime, on real text.

What is measured, in one process and in this order:

1. session creation (seconds), with ``Rss``/``Anonymous`` from ``/proc/self/smaps_rollup`` before it,
   after loading the tokenizer (Gemma's holds ~100 MB) and importing onnx and onnxruntime (their own
   4–11 MB after the tokenizer, ~20 MB alone): both reported apart, costs of the process, not of the
   model. "Session creation" also counts what comes with it: reading and checking the manifest and
   the graph, and moving the packed weights onto huge pages (``--huge-pages``);
2. for each prompt length (shortest first): a prefill of that many tokens of real text (ms), then
   ``new_tokens`` greedy decode steps through the KV cache (ms per step, with the context length);
3. memory after the shortest prompt and its decode steps (the "session + a few decode steps" figure
   of issue #2) and after everything (the 512-token prefill's working memory included), both once
   each generation's KV cache is freed; and memory in use at each prompt's last step, its cache
   live (the largest of these: read once per prompt, outside the timed steps);
4. peak resident memory (``VmHWM``), archive size;
5. the CPU time other processes took while 2. ran (``/proc/stat``), so that a run on a busy
   machine says so.

Decode medians and p90 exclude the first ``WARMUP_STEPS`` steps of each prompt. The figures are
machine-dependent; compare ratios measured in the same run.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import importlib
import io
import json
import os
import platform
import stat
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .boards import BOARDS, DEFAULT_THREADS, board as find_board
from .errors import BudgetExceeded, ConfigError, GemmaExportError, check_arguments
from .memory import peak_rss_bytes, release_free_heap, snapshot
from .onnx_files import MANIFEST_FILE, MODEL_FILE
from .runtime import DEFAULT_PREFILL_CHUNK, limit_name, max_positions
from .text_files import text_bytes_for

WARMUP_STEPS = 4
#: fewer timed decode steps than this per prompt are named in the report: a median of a handful is noisy
FEW_TIMED_STEPS = 16


def real_text(path: str | Path | None = None, max_bytes: int | None = None) -> tuple[str, str]:
    """Real English written by others, for prompts: ``(text, where it came from)``. ``max_bytes``:
    read no more of a given file (``text_files.read_text_file``).

    Default: the Python license shipped with the interpreter (``LICENSE.txt`` in the standard
    library), else the license file of the installed numpy (Debian's Python omits the former).

    Raises:
        SourceNotFoundError: ``path`` is given and missing or unreadable, or no default text is installed.
        FormatError: ``path`` is not UTF-8 text.
    """
    from importlib import metadata

    from .errors import SourceNotFoundError
    from .text_files import read_text_file

    if path is not None:
        return read_text_file(path, "text file", max_bytes), str(path)
    candidate = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if candidate.is_file():
        return candidate.read_text(encoding="utf-8"), str(candidate)
    try:
        for f in metadata.distribution("numpy").files or ():
            if f.name.upper().startswith("LICENSE"):
                located = Path(f.locate())
                if located.is_file() and located.stat().st_size > 4000:
                    return located.read_text(encoding="utf-8", errors="replace"), str(located)
    except metadata.PackageNotFoundError:
        pass
    raise SourceNotFoundError("no real text found (Python's LICENSE.txt, numpy's LICENSE); pass --text FILE")


@dataclasses.dataclass
class BenchResult:
    """Figures of one ``bench`` run. Times in ms (session creation in s), memory in bytes.

    Attributes:
        model: the export folder.
        threads: onnxruntime intra-op threads.
        archive_bytes: the export's files (:func:`archive_bytes`).
        session_create_s: ``OnnxDecoder`` creation, seconds.
        prefill_ms: prompt length in tokens → prefill time.
        decode_ms_median, decode_ms_p90: over every timed decode step of every prompt length.
        tokens_per_s: 1000 / ``decode_ms_median``.
        decode_curve: ``(context length, ms)`` of every timed decode step.
        anon_growth_short_bytes, rss_growth_short_bytes: growth of ``Anonymous`` and ``Rss``
            (``/proc/self/smaps_rollup``) over session creation, the shortest prompt and its steps.
        anon_growth_bytes, rss_growth_bytes: the same after every prompt length.
        anon_in_use_bytes, rss_in_use_bytes: growth at the last decode step of the prompt where
            ``Anonymous`` was largest, that generation's KV cache live (None: not measured). The
            two figures above come after each cache is freed.
        in_use_prompt_tokens: that prompt's length.
        peak_rss_bytes: the process's peak resident memory.
        text_source: where the prompts' text came from.
        board, board_memory_bytes: the ``--board`` and its memory budget (None without one).
        board_headroom_bytes, board_fits: the memory the board must keep free, and whether the peak
            leaves it (None without a board; ``bench`` exits with status 1 when it does not).
        prefill_chunk: prompt tokens per prefill step (None: the whole prompt in one).
        prepacked, prepacked_note: the pre-packed copy's ``model.onnx`` the session loaded (None:
            ``model.onnx``), and why it was or was not used.
        huge_page_bytes: heap moved onto transparent huge pages after session creation.
        reference: the reference MLIR export under IREE (ms/token and the ratio), see :func:`run_bench`.
        new_tokens: decode steps after each prompt (the first ``WARMUP_STEPS`` untimed).
        decode_ms_median_by_prompt: prompt length → median ms/token of the steps after it.
        anon_libraries_bytes, rss_libraries_bytes: what importing onnx and onnxruntime added before
            the growth's baseline (0: imported earlier).
        anon_tokenizer_bytes, rss_tokenizer_bytes: what the loaded tokenizer holds, also before the
            baseline.
        machine: where the figures were measured, e.g. ``"x86_64, 2 CPUs"`` (``--board`` sets threads
            and the memory budget; the times stay this machine's).
        other_cpus: CPUs' worth of work that other processes did while the prompts and decode steps
            were timed (:func:`other_cpus`; None where ``/proc/stat`` is unavailable). From
            :data:`BUSY_OTHER_CPUS` on, the report says the times are not the model's alone.
    """

    model: str
    threads: int | None
    archive_bytes: int
    session_create_s: float
    prefill_ms: dict[int, float]
    decode_ms_median: float
    decode_ms_p90: float
    tokens_per_s: float
    decode_curve: list[tuple[int, float]]
    anon_growth_short_bytes: int
    rss_growth_short_bytes: int
    anon_growth_bytes: int
    rss_growth_bytes: int
    peak_rss_bytes: int
    text_source: str
    board: str | None = None
    board_memory_bytes: int | None = None
    board_headroom_bytes: int | None = None
    board_fits: bool | None = None
    prefill_chunk: int | None = None
    prepacked: str | None = None
    prepacked_note: str = ""
    huge_page_bytes: int = 0
    reference: dict | None = None
    new_tokens: int | None = None
    decode_ms_median_by_prompt: dict[int, float] = dataclasses.field(default_factory=dict)
    anon_libraries_bytes: int = 0
    rss_libraries_bytes: int = 0
    anon_tokenizer_bytes: int = 0
    rss_tokenizer_bytes: int = 0
    machine: str = ""
    other_cpus: float | None = None
    anon_in_use_bytes: int | None = None
    rss_in_use_bytes: int | None = None
    in_use_prompt_tokens: int | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


#: Linux's switch for dropping clean page-cache pages (root only)
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_page_cache() -> None:
    """Write dirty pages back (``sync``) and drop the clean page cache (``1`` into
    ``/proc/sys/vm/drop_caches``), so that the next run reads its model files from disk, as after a
    reboot. Memory-bound decode timings depend on how a file's pages came into the cache: int8
    copies with the same graph decoded up to 18% apart, a file just written against one that had sat
    in the cache for hours, and alike once both were re-read (``docs/benchmarks-history.md``). Linux, root.

    Raises:
        GemmaExportError: the page cache cannot be dropped here (not root, not Linux); names the file.
    """
    import os

    os.sync()
    try:
        DROP_CACHES.write_text("1\n")
    except OSError as exc:
        raise GemmaExportError(f"{DROP_CACHES}: cannot drop the page cache ({exc.strerror or exc}); "
                               "cold runs need root on Linux") from None


def archive_bytes(model_dir: Path) -> int:
    """Bytes of an export's ONNX archive: every file of ``model_dir`` (not its sub-folders' files) whose
    name starts with ``model.onnx``, i.e. ``model.onnx`` and its external data ``model.onnx.data``."""
    return sum(p.stat().st_size for p in model_dir.iterdir() if p.name.startswith(MODEL_FILE))


def run_bench(model_dir: str | Path, threads: int | None = None, prompt_tokens: Sequence[int] = (16, 128, 512),
              new_tokens: int = 128, board: str | None = None, text: str | Path | None = None,
              reference: str | Path | None = None, reference_weights: str | Path | None = None,
              prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, progress: Callable[[str], None] | None = None,
              prepacked: bool | None = None, huge_pages: bool = True) -> BenchResult:
    """Measure an export folder with onnxruntime (``CPUExecutionProvider``, greedy decoding).

    Args:
        model_dir: an export folder (``model.onnx``, ``model.onnx.data``, ``tokenizer.json``).
        threads: intra-op threads (None: the ``board``'s, else ``boards.DEFAULT_THREADS``; given, it wins over the board's).
        prompt_tokens: prompt lengths in tokens, each > 0.
        new_tokens: decode steps after each prompt, > ``WARMUP_STEPS``.
        board: a key of ``boards.BOARDS``: sets threads and checks the memory budget.
        text: a text file for prompts (default: ``real_text()``).
        reference, reference_weights: the board team's reference export (``.mlir`` + archive),
            checked and compiled with IREE for this CPU before the export is measured (in a child
            process, into IREE's cache: an MLIR IREE refuses is named before minutes of work, and
            the compiler's memory is not this process's), loaded after the export's figures are
            taken, and timed the way the board runs it: the fixed-length re-decode graph once per
            new token, after a prompt of the shortest length that leaves room (at most 16 tokens). ``result.reference`` then
            holds its ms/token and the ratio of the export's decode median at the shortest prompt.
        prefill_chunk: feed each prompt in steps of at most this many tokens (None: one step;
            default :data:`~gemma_export.runtime.DEFAULT_PREFILL_CHUNK`, llama.cpp's default batch).
        prepacked: the folder's pre-packed copy: None uses it when made here, True requires it,
            False ignores it (see :class:`~gemma_export.runtime.OnnxDecoder`).
        huge_pages: without the copy, move the heap-packed weights onto transparent huge pages
            after session creation (``OnnxDecoder(huge_pages=...)``); False to measure without.

    Returns:
        A :class:`BenchResult` (times in ms, memory in bytes). The board's memory budget is not
        checked here: :func:`check_board_budget` raises if the result leaves too little of it.

    Raises:
        GemmaExportError: bad arguments, unknown board, text shorter than the longest prompt, the
            longest prompt and the decode steps beyond ``max_position_embeddings``.
        ConfigError: an argument of the wrong type (:func:`~gemma_export.errors.check_arguments`).
        SourceNotFoundError: no such export folder or ``text`` file; no real text found by default.
        FormatError: the folder's files cannot be loaded, or its tokenizer gives ids outside the
            graph's vocabulary (:class:`~gemma_export.runtime.OnnxDecoder`).
        NumericError: the export computes NaN or +Inf logits.
        ResourceError: the KV cache would not fit in available memory (the board's budget is
            checked apart, by :func:`check_board_budget`).
    """
    check_arguments("run_bench", model_dir=(model_dir, "path"), threads=(threads, "int?"),
                    prompt_tokens=(prompt_tokens, "ints"), new_tokens=(new_tokens, "int"), board=(board, "str?"),
                    text=(text, "path?"), reference=(reference, "path?"), reference_weights=(reference_weights, "path?"),
                    prefill_chunk=(prefill_chunk, "int?"), prepacked=(prepacked, "bool?"), huge_pages=(huge_pages, "bool"),
                    progress=(progress, "callable?"))
    from .runtime import OnnxDecoder, check_prefill_chunk, import_runtime_libraries, load_tokenizer, positions_needed
    from .text_files import first_tokens

    say = progress or (lambda _msg: None)
    model_dir = Path(model_dir)
    lengths = sorted(set(int(n) for n in prompt_tokens))
    if not lengths or lengths[0] <= 0:
        raise ConfigError(f"--prompt-tokens: expected positive lengths, found {list(prompt_tokens)}")
    if len(lengths) != len(prompt_tokens):  # one run per length: a repeat would be measured once, silently
        repeated = sorted(n for n, count in collections.Counter(int(n) for n in prompt_tokens).items() if count > 1)
        raise ConfigError(f"--prompt-tokens: each length once; {', '.join(map(str, repeated))} given more than once")
    check_prefill_chunk(prefill_chunk)  # before the session is created
    if new_tokens <= WARMUP_STEPS:
        raise ConfigError(f"--new-tokens: expected more than {WARMUP_STEPS} (warm-up steps), found {new_tokens}")
    if reference is None and reference_weights is not None:
        raise ConfigError("--reference-weights applies to --reference, which is not given")
    info = None
    if reference is not None:  # its files, their contents and IREE before the (long) measurement, not after it
        from .reference_iree import check_reference_options

        info = check_reference_options(reference, reference_weights)
        reference_prompt(reference, info.sequence_length)
    spec = find_board(board) if board is not None else None
    if threads is None:
        threads = spec.threads if spec is not None else DEFAULT_THREADS
    needed = positions_needed(lengths[-1], new_tokens + 1)  # the prefill's token, then new_tokens steps
    limit = max_positions(model_dir)  # a genai folder: its genai_config.json
    if limit and needed > limit:  # before the text and the (slow) session; decoder.check_length checks again below
        raise GemmaExportError(f"{model_dir}: the longest prompt ({lengths[-1]} tokens) and {new_tokens} decode steps "
                               f"need {needed} positions; {limit_name(model_dir)} is {limit}")
    # a prefix: a huge --text is neither read nor tokenized whole
    needed_ids = max(lengths[-1], REFERENCE_PROMPT_TOKENS if reference else 0)
    body, source = real_text(text, text_bytes_for(needed_ids))
    importlib.import_module("tokenizers")  # the library's own ~4 MB of Rss are not the tokenizer's
    release_free_heap()
    start = snapshot()
    tokenizer = load_tokenizer(model_dir)  # kept for the run, as `generate` keeps it
    tokenizer_memory = snapshot() - start
    ids = first_tokens(tokenizer, body, needed_ids)
    compile_s = 0.0
    if info is not None:  # the ids the reference will be fed must be its tokens
        fed = ids[:REFERENCE_PROMPT_TOKENS]
        if outside := [i for i in fed if not 0 <= i < info.vocab_size]:
            raise GemmaExportError(f"{reference}: token id {outside[0]} of the text's first {len(fed)} is outside the "
                                   f"reference's vocabulary ({info.vocab_size} rows); is it the same model as {model_dir}?")
        from .reference_iree import compile_in_child

        say(f"reference: compiling {reference} with IREE for this CPU (before the measurement, in a child process)")
        t0 = time.perf_counter()
        compile_in_child(reference)  # an MLIR IREE refuses is named now; the module is cached for later
        compile_s = time.perf_counter() - t0
    if len(ids) < lengths[-1]:
        raise GemmaExportError(f"{source}: {len(ids)} token{'' if len(ids) == 1 else 's'} (with <bos>), fewer than the "
                               f"longest prompt ({lengths[-1]}); give a longer --text or shorter --prompt-tokens")

    release_free_heap()
    start = snapshot()
    import_runtime_libraries()  # a fixed cost of the process, reported apart from the model's growth
    release_free_heap()
    before = snapshot()
    libraries = before - start
    t0 = time.perf_counter()
    decoder = OnnxDecoder(model_dir, threads=threads, prepacked=prepacked, huge_pages=huge_pages)
    create_s = time.perf_counter() - t0
    say(f"session created in {create_s:.1f} s" + (f" from the {decoder.prepacked_note}" if decoder.prepacked_path else ""))
    decoder.check_length(needed)
    decoder.check_ids(ids[:lengths[-1]], source)  # every prompt's ids, before the first is timed

    prefill_ms: dict[int, float] = {}
    by_prompt: dict[int, float] = {}
    timed: list[float] = []
    curve: list[tuple[int, float]] = []
    short = None
    in_use = []  # growth at each prompt's last step, its KV cache live
    picked: list[int] = []

    def at_last_step(token: int) -> None:  # greedy's on_token, called outside the timed steps
        picked.append(token)
        if len(picked) == new_tokens + 1 and (now := snapshot()).rss_bytes:  # Rss 0: no /proc to read
            in_use.append((now - before, n))  # n: the prompt being decoded (the loop below)

    with OtherWork() as other:  # other processes' CPU use while the prompts and steps are timed
        for n in lengths:
            picked.clear()
            # the prefill yields the first token, then ``new_tokens`` decode steps (step i at context n + i + 1)
            _, prefill_ms[n], decode_ms = decoder.greedy(ids[:n], new_tokens + 1, stop_ids=[],
                                                         prefill_chunk=prefill_chunk, on_token=at_last_step)
            for step, ms in enumerate(decode_ms):
                if step >= WARMUP_STEPS:
                    timed.append(ms)
                    curve.append((n + step + 1, ms))
            by_prompt[n] = statistics.median(decode_ms[WARMUP_STEPS:])
            say(f"prompt {n} tokens: prefill {prefill_ms[n]:.0f} ms, decode median {by_prompt[n]:.1f} ms/token")
            if short is None:
                short = snapshot() - before
    after = snapshot() - before
    live, live_prompt = max(in_use, key=lambda m: m[0].anonymous_bytes) if in_use else (None, None)
    median = statistics.median(timed)
    p90 = float(np.percentile(timed, 90))
    peak = peak_rss_bytes()
    loaded = {"prepacked": str(decoder.prepacked_path) if decoder.prepacked_path else None,
              "prepacked_note": decoder.prepacked_note, "huge_page_bytes": decoder.huge_page_bytes}
    del decoder  # the session's memory goes before IREE compiles and runs the reference (a 1.9 GB board holds one)
    reference_figures = time_reference(reference, reference_weights, ids, by_prompt[lengths[0]], say,
                                       compile_s=compile_s) if reference else None
    result = BenchResult(
        model=str(model_dir), threads=threads, archive_bytes=archive_bytes(model_dir), session_create_s=create_s,
        prefill_ms=prefill_ms, decode_ms_median=median, decode_ms_p90=p90, tokens_per_s=1e3 / median,
        decode_curve=curve, anon_growth_short_bytes=short.anonymous_bytes, rss_growth_short_bytes=short.rss_bytes,
        anon_growth_bytes=after.anonymous_bytes, rss_growth_bytes=after.rss_bytes, peak_rss_bytes=peak,
        anon_in_use_bytes=live.anonymous_bytes if live else None, rss_in_use_bytes=live.rss_bytes if live else None,
        in_use_prompt_tokens=live_prompt,
        anon_libraries_bytes=libraries.anonymous_bytes, rss_libraries_bytes=libraries.rss_bytes,
        anon_tokenizer_bytes=tokenizer_memory.anonymous_bytes, rss_tokenizer_bytes=tokenizer_memory.rss_bytes,
        text_source=source, board=board, board_memory_bytes=spec.memory_bytes if spec else None,
        board_headroom_bytes=spec.headroom_bytes if spec else None,
        board_fits=fits_board(spec, peak) if spec else None,
        prefill_chunk=prefill_chunk, machine=f"{platform.machine() or 'unknown'}, {usable_cpus()} CPUs", other_cpus=other.cpus,
        **loaded, reference=reference_figures, new_tokens=new_tokens,
        decode_ms_median_by_prompt=by_prompt)
    return result


#: prompt tokens before the reference export's timed re-decode loop (fewer when its fixed length is short)
REFERENCE_PROMPT_TOKENS = 16


def reference_prompt(mlir: str | Path, sequence_length: int) -> int:
    """Prompt tokens before the timed re-decode loop of a reference of fixed length ``sequence_length``:
    :data:`REFERENCE_PROMPT_TOKENS`, fewer when that leaves under 4 steps.

    Raises:
        GemmaExportError: the fixed length leaves no room (under 5).
    """
    prompt = min(REFERENCE_PROMPT_TOKENS, sequence_length - 4)
    if prompt < 1:
        raise GemmaExportError(f"{mlir}: fixed length {sequence_length} leaves no room to time a re-decode loop "
                               "(at least 5 positions: a prompt token and 4 steps)")
    return prompt


def time_reference(mlir: str | Path, archive: str | Path | None, ids: Sequence[int], export_decode_ms: float,
                   say: Callable[[str], None], compile_s: float = 0.0) -> dict:
    """Time the reference export's re-decode loop (one whole-graph call per new token) after a
    prompt of ``ids[:min(REFERENCE_PROMPT_TOKENS, S - 4)]`` (16); times in ms, ``export_vs_reference`` =
    ``export_decode_ms`` / its median; ``compile_and_load_s`` adds ``compile_s`` (the compile
    :func:`run_bench` ran before the measurement, seconds) to the load.

    Raises:
        GemmaExportError: the reference's fixed length S leaves no room for a prompt (S < 5), or
            what :func:`~gemma_export.reference_iree.load_reference` raises (a missing or malformed
            ``.mlir`` or archive, IREE not installed).
    """
    from .reference_iree import load_reference

    say(f"reference: loading {mlir} for IREE")
    t0 = time.perf_counter()
    model = load_reference(mlir, archive)
    load_s = time.perf_counter() - t0
    context = list(ids[:reference_prompt(mlir, model.sequence_length)])
    model.run(context)  # warm-up
    steps = []
    with OtherWork() as other:
        while len(context) < model.sequence_length:
            t = time.perf_counter()
            out = model.run(context)
            steps.append((time.perf_counter() - t) * 1e3)
            context.append(int(out[len(context) - 1]))
    per_token = statistics.median(steps)
    say(f"reference: {per_token:.1f} ms/token (re-decode of {model.sequence_length} positions)")
    return {"mlir": str(mlir), "compile_and_load_s": compile_s + load_s, "sequence_length": model.sequence_length,
            "prompt_tokens": len(context) - len(steps), "new_tokens": len(steps), "ms_per_token_median": per_token,
            "export_decode_ms_median": export_decode_ms, "export_vs_reference": export_decode_ms / per_token,
            "other_cpus": other.cpus}


def fits_board(spec, peak_rss_bytes: int) -> bool:
    """Whether a peak resident memory (bytes) leaves a board (:data:`~gemma_export.boards.BOARDS`
    entry) its headroom free: peak ≤ memory − headroom."""
    return peak_rss_bytes <= spec.memory_bytes - spec.headroom_bytes


def check_board_budget(result: BenchResult) -> None:
    """Raises BudgetExceeded (exit status 1) when ``result`` ran for a board and its peak memory leaves less than
    the board's headroom free (call it after the figures are shown and saved).

    Raises:
        BudgetExceeded: as above.
        ConfigError: ``result`` is not a :class:`BenchResult`, or names a board this toolkit does not
            know (:data:`~gemma_export.boards.BOARDS`).
    """
    if not isinstance(result, BenchResult):
        raise ConfigError(f"check_board_budget: result must be a BenchResult (what run_bench returns), found "
                          f"{type(result).__name__}")
    if result.board is None:
        return
    if result.board not in BOARDS:
        raise ConfigError(f"check_board_budget: result.board is {result.board!r}; expected one of "
                          f"{', '.join(sorted(BOARDS))} or None")
    spec = BOARDS[result.board]
    if not fits_board(spec, result.peak_rss_bytes):
        board = f"the {result.board}'s"
        budget = spec.memory_bytes - spec.headroom_bytes
        over_mb = (result.peak_rss_bytes - budget) / 1e6
        raise BudgetExceeded(
            f"{result.model}: peak resident memory {result.peak_rss_bytes / 1e6:,.0f} MB "
            f"{_room(spec.memory_bytes, result.peak_rss_bytes, board)}; at least {spec.headroom_bytes / 1e6:.0f} MB "
            f"must stay free, so the model may use {budget / 1e6:,.0f} MB: "
            + (f"{over_mb:,.0f} MB over" if over_mb >= 0.5 else "less than 1 MB over"))


def _room(memory_bytes: int, peak_bytes: int, whose: str) -> str:
    """"leaves N MB of <whose> X GB", or "exceeds <whose> X GB by N MB" when the peak is larger."""
    left = memory_bytes - peak_bytes
    if left >= 0:
        return f"leaves {left / 1e6:,.0f} MB of {whose} {memory_bytes / 1e9:.1f} GB"
    return f"exceeds {whose} {memory_bytes / 1e9:.1f} GB by {-left / 1e6:,.0f} MB"


#: the kernel's CPU time counters, all CPUs together (first line ``cpu  user nice system idle ...``)
PROC_STAT = Path("/proc/stat")
#: other processes' CPU use during the measurement (CPUs' worth) from which the report warns
BUSY_OTHER_CPUS = 0.2
#: the shortest window :func:`other_cpus` gives a figure for, seconds: the counters tick every 10 ms,
#: so one tick over a 30 ms `generate` read as 0.33 CPUs (a tester saw 5.92 of 2 CPUs); over 0.25 s
#: a tick or two is 0.04-0.08 CPUs, under the 0.2 that the notes start from, and a busy machine's
#: default `generate` (32 steps at 16 ms) is still measured
OTHER_CPUS_MIN_SECONDS = 0.25


def cpu_seconds() -> tuple[float, float, float] | None:
    """``(busy, own, wall)`` seconds: CPU time every CPU spent on work (``/proc/stat``: user, nice,
    system, irq, softirq and steal, in ``USER_HZ`` ticks), this process's own CPU time (every thread,
    ``os.times``), and a monotonic clock. The differences of two readings give the CPU time other
    processes took in between (:func:`other_cpus`). None where ``/proc/stat`` cannot be read or parsed
    (not Linux)."""
    try:
        fields = PROC_STAT.read_text().split("\n", 1)[0].split()
        if fields[0] != "cpu":
            return None
        # guest and guest_nice (fields 9, 10) are already counted in user and nice
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    own = os.times()
    return (user + nice + system + irq + softirq + steal) / ticks, own.user + own.system, time.monotonic()


def other_cpus(before: tuple[float, float, float] | None, after: tuple[float, float, float] | None) -> float | None:
    """How many CPUs' worth of work processes other than this one did between two
    :func:`cpu_seconds` readings (``(Δbusy − Δown) / Δwall``; 0.0 for an idle machine, 1.0 for one
    other busy core). Both counters tick at ``USER_HZ`` (10 ms), so a window of a second or more
    gives a figure to 0.01–0.02 CPUs; a small negative difference is that rounding and counts as 0.
    None without both readings, over less than :data:`OTHER_CPUS_MIN_SECONDS`, or where
    ``/proc/stat`` counted clearly less than this process used (a container's virtualized
    ``/proc/stat``: the figure would mean nothing). Never more than the machine's other CPUs'
    worth can be, ``os.cpu_count()``."""
    if before is None or after is None or after[2] - before[2] < OTHER_CPUS_MIN_SECONDS:
        return None
    busy, own, wall = after[0] - before[0], after[1] - before[1], after[2] - before[2]
    if busy - own < -0.05 * wall - 0.02:  # more than the ticks' rounding
        return None
    return min(max(0.0, (busy - own) / wall), float(os.cpu_count() or 1))


class OtherWork:
    """``with OtherWork() as other: …`` — afterwards ``other.cpus`` is what :func:`other_cpus` gives
    for the block (None where it cannot be measured). Put it around the timed work only: a model's
    load from disk makes the kernel work for this process in ways ``/proc/stat`` books as others'."""

    cpus: float | None = None

    def __enter__(self) -> "OtherWork":
        self._before = cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        self.cpus = other_cpus(self._before, cpu_seconds())


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the system has one, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def format_result(r: BenchResult) -> str:
    """A human-readable summary of a ``BenchResult``."""
    a = r.archive_bytes
    steps = f" and its {r.new_tokens} decode steps" if r.new_tokens else ""
    freed = ", the KV cache freed" if r.anon_in_use_bytes is not None else ""
    lines = [
        f"model            {r.model} ({a / 1e6:,.1f} MB archive, {r.threads} thread{'' if r.threads == 1 else 's'})",
        f"session creation {r.session_create_s:.2f} s",
        "graph            " + (f"{r.prepacked} (pre-packed weights mapped from disk)" if r.prepacked else
                               "model.onnx, weights packed on the heap"
                               + (f" ({r.huge_page_bytes / 1e6:,.0f} MB of the process's heap moved onto huge pages, the weights' and the rest's)" if r.huge_page_bytes else "")
                               + (f"; {r.prepacked_note}" if r.prepacked_note else
                                  # only for a folder prepack takes (another tool's, e.g. genai's, has no manifest)
                                  "; `gemma-export prepack` maps them from disk" if (Path(r.model) / MANIFEST_FILE).is_file()
                                  else "")),
        *[f"prefill {n:>5} tok  {ms:,.1f} ms" + (f" (steps of {r.prefill_chunk})" if r.prefill_chunk and n > r.prefill_chunk else "")
          for n, ms in r.prefill_ms.items()],
        f"decode           median {r.decode_ms_median:.1f} ms/token, p90 {r.decode_ms_p90:.1f} ms "
        f"({r.tokens_per_s:.1f} tokens/s)" + (" over the steps after every prompt: " + ", ".join(
            f"{ms:.1f} after {n}" for n, ms in r.decode_ms_median_by_prompt.items())
            if len(r.decode_ms_median_by_prompt) > 1 else "")
        + (f"; only {timed} timed step{'' if timed == 1 else 's'} per prompt (--new-tokens {WARMUP_STEPS + FEW_TIMED_STEPS} "
           "or more for steadier figures)" if r.new_tokens is not None and (timed := r.new_tokens - WARMUP_STEPS) < FEW_TIMED_STEPS
           else ""),
        *([f"other work       other processes used {r.other_cpus:.2f} of the machine's {os.cpu_count() or 1} CPUs while "
           "the prompts and steps were timed" + ("" if r.other_cpus < BUSY_OTHER_CPUS else
                                                 ": these times are not this model's alone; measure again on an "
                                                 "idle machine, or compare ratios taken in one run")]
          if r.other_cpus is not None else []),
        f"memory growth    after the {min(r.prefill_ms)}-token prompt{steps}{freed}: Anonymous {r.anon_growth_short_bytes / 1e6:,.0f} MB "
        f"({r.anon_growth_short_bytes / a:.2f}x archive), Rss {r.rss_growth_short_bytes / 1e6:,.0f} MB "
        f"({r.rss_growth_short_bytes / a:.2f}x)",
        *([f"                 after all prompts{' and their steps' if r.new_tokens else ''}{freed}: Anonymous "
           f"{r.anon_growth_bytes / 1e6:,.0f} MB ({r.anon_growth_bytes / a:.2f}x), Rss {r.rss_growth_bytes / 1e6:,.0f} MB "
           f"({r.rss_growth_bytes / a:.2f}x)"] if len(r.prefill_ms) > 1 else []),  # one prompt: the line above
        *([f"in use           at the last step after the {r.in_use_prompt_tokens}-token prompt, its KV cache live"
           + (" (the largest of the prompts')" if len(r.prefill_ms) > 1 else "") + ": "
           f"Anonymous {r.anon_in_use_bytes / 1e6:,.1f} MB ({r.anon_in_use_bytes / a:.3f}x archive), "
           f"Rss {r.rss_in_use_bytes / 1e6:,.1f} MB ({r.rss_in_use_bytes / a:.3f}x)"]
          if r.anon_in_use_bytes is not None else []),
        "libraries        " + (f"importing onnx and onnxruntime took Anonymous {r.anon_libraries_bytes / 1e6:,.0f} MB, "
                               f"Rss {r.rss_libraries_bytes / 1e6:,.0f} MB, before the baseline of the growth above"
                               if r.rss_libraries_bytes >= 1_000_000 else "onnx and onnxruntime were imported before this run"),
        f"tokenizer        the loaded tokenizer holds Anonymous {r.anon_tokenizer_bytes / 1e6:,.0f} MB, "
        f"Rss {r.rss_tokenizer_bytes / 1e6:,.0f} MB, also before that baseline",
        f"peak resident    {r.peak_rss_bytes / 1e6:,.0f} MB (whole process)",
        f"prompts          real text from {r.text_source}",
    ]
    if r.reference:
        ref = r.reference
        lines.append(f"reference        {ref['ms_per_token_median']:,.1f} ms/token under IREE (re-decode of "
                     f"{ref['sequence_length']} positions, {ref['new_tokens']} tokens after {ref['prompt_tokens']}); "
                     f"export {ref['export_decode_ms_median']:.1f} ms/token = {ref['export_vs_reference']:.3f}x the reference")
    if r.board:
        where = f" ({r.machine})" if r.machine else ""
        verdict, headroom = "", ""
        if r.board_headroom_bytes is not None:
            verdict = "fits: " if r.board_fits else "does NOT fit: "
            headroom = f" (at least {r.board_headroom_bytes / 1e6:,.0f} MB must stay free)"
        lines.append(f"board {r.board}: {verdict}peak {_room(r.board_memory_bytes, r.peak_rss_bytes, 'its')}{headroom}; the times "
                     f"above were measured on this machine{where}, with {r.threads} thread{'' if r.threads == 1 else 's'}")
    return "\n".join(lines)


def to_stdout(path: str | Path | None) -> bool:
    """Whether ``--json PATH`` means standard output: ``-``, ``/dev/stdout``, ``/proc/self/fd/1``, or
    a path naming the very file or pipe standard output is (e.g. the file it was redirected to). The
    commands then print their text report on stderr, so stdout holds the JSON alone."""
    if path is None:
        return False
    if str(path) in ("-", "/dev/stdout", "/proc/self/fd/1"):
        return True
    try:
        return os.path.samestat(os.stat(path), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # no such file; stdout captured
        return False


def check_outputs(json_out: str | Path | None, plot: str | Path | None,
                  inputs: Sequence[str | Path | None] = (), report_key: str | None = None) -> None:
    """Fail before measuring when an output cannot be written: a missing folder, one that refuses
    files (``staging.entry_refused``), a file name longer than its file system takes, the same file
    for both outputs, a plot that is not ``.png``, no matplotlib for ``--plot``, or
    an output that would overwrite one of the command's ``inputs`` (a file, or anything inside an
    input folder such as the export's own ``manifest.json``), a file inside any export or bundle
    folder of this toolkit (``staging.enclosing_output``: its manifest would stop verifying), or an
    existing file that an earlier run did not write (:func:`kept_file`: e.g. the export's source
    weights, a model's ``config.json``, or with ``report_key`` a JSON file without that key at its
    top level, such as a prompts list or someone's notes, named by mistake).

    Raises:
        OutputError, GemmaExportError: naming the option and the path.
    """
    from .errors import OutputError
    from .staging import enclosing_output, entry_refused, max_name_bytes

    targets = {}  # option -> the resolved file it names
    for option, path in (("--json", json_out), ("--plot", plot)):
        if path is None or (option == "--json" and to_stdout(path)):
            continue
        try:
            targets[option] = Path(path).resolve()
        except (RuntimeError, OSError) as exc:  # a loop of symbolic links (RuntimeError before Python 3.13)
            raise OutputError(f"{option} {path}: cannot be resolved ({exc}); give a file name that leads to a file") from None
        folder = os.path.dirname(str(path)) or "."  # as the file will be opened: "loop/../x" is not resolved away
        name_max, name_bytes = max_name_bytes(Path(folder)), len(os.fsencode(targets[option].name))
        if name_bytes > name_max:  # now, not when the report is written at the end
            raise OutputError(f"{option} {path}: a file name of {name_bytes} bytes; this file system takes at most "
                              f"{name_max}")
        if not os.path.isdir(folder):
            try:
                os.stat(folder)
            except OSError as exc:  # a missing folder is named further down
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                    raise OutputError(f"{option} {path}: its folder {folder} cannot be reached ({exc.strerror}); give a "
                                      "file name that leads to a file") from None
    if len(targets) == 2 and targets["--json"] == targets["--plot"]:
        raise OutputError(f"--json {json_out} and --plot {plot} name the same file; give each its own")
    for option, path in (("--json", json_out), ("--plot", plot)):
        if option not in targets:
            continue
        if _under_dev_or_proc(path) and Path(path).exists() and not Path(path).is_file() and not Path(path).is_dir():
            # a device or a descriptor that is a pipe (/dev/stderr piped on, /dev/fd/63 of a shell's
            # >(...)): written in place, as write_json does; its "folder" (/proc/PID/fd) is no folder
            if not os.access(path, os.W_OK):
                raise OutputError(f"{option} {path}: not writable")
            continue
        target = targets[option]
        if target.is_dir():
            raise OutputError(f"{option} {path}: is a folder; expected a file name")
        for given in inputs:
            if given is None or not Path(given).exists():
                continue
            source = Path(given).resolve()
            if target == source or (source.is_dir() and source in target.parents):
                what = ("overwrite the input" if target == source else
                        "overwrite a file in the input" if target.exists() else "write into the input folder")
                raise OutputError(f"{option} {path}: would {what} {given}; write it elsewhere")
        # /dev and /proc paths are written in place (write_json), even when they lead to a file
        kept = None if _under_dev_or_proc(path) or not target.is_file() else kept_file(target, option, report_key)
        if kept is not None:
            raise OutputError(f"{option} {path}: exists and {kept}; refusing to overwrite it; write it elsewhere")
        enclosing = enclosing_output(target)
        if enclosing is not None:
            raise OutputError(f"{option} {path}: would write into {enclosing}, an output of gemma-export whose manifest "
                              "would no longer list every file in it; write it elsewhere")
        parent = target.parent
        if parent.exists() and not parent.is_dir():
            raise OutputError(f"{option} {path}: {parent} is a file, not a folder")
        if not parent.is_dir():
            raise OutputError(f"{option} {path}: folder {parent} does not exist")
        reason = entry_refused(parent)  # a folder that exists may still refuse files (/proc, read-only mounts)
        if reason is not None:
            raise OutputError(f"{option} {path}: cannot write a file in {parent}: {reason}")
    if plot is not None:
        if Path(plot).suffix.lower() != ".png":
            raise OutputError(f"--plot {plot}: expected a .png file name")
        _pyplot()


#: an existing --json file larger than this is not read to see whether it may be replaced: it is kept
REPORT_LIMIT_BYTES = 64 << 20
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: JSON files of model folders (transformers, onnxruntime-genai, this toolkit): never a report
MODEL_JSON_FILES = frozenset({"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                              "special_tokens_map.json", "genai_config.json", "manifest.json", "BUNDLE.json",
                              "model.safetensors.index.json", "preprocessor_config.json", "added_tokens.json"})


def _under_dev_or_proc(path: str | Path) -> bool:
    """Whether ``path`` (made absolute, links not followed) lies under ``/dev`` or ``/proc``: a device or
    a descriptor such as ``/dev/stderr``, written in place even when it leads to a regular file."""
    return Path(os.path.abspath(path)).parts[1:2] in (("dev",), ("proc",))


def kept_file(path: Path, option: str, report_key: str | None = None) -> str | None:
    """Why an existing regular file must not be overwritten by ``option`` (``"is not ..."``), or None
    when it may be: an empty file, or what an earlier run wrote, unless no one may write it (JSON text under
    ``REPORT_LIMIT_BYTES`` that is not one of a model folder's own files, ``MODEL_JSON_FILES``, and,
    given ``report_key``, a JSON object with that key, for ``--json``; a PNG image for ``--plot``).
    So the export's source weights, a model's ``config.json``, a prompts list or someone's notes,
    named by mistake, are kept."""
    report = "a JSON report" if option == "--json" else "a PNG image"
    try:
        found = path.stat()
        if not found.st_mode & 0o222:  # the rename would replace it whatever its mode (for root, too)
            return f"is write-protected (mode {stat.S_IMODE(found.st_mode):o})"
        size = found.st_size
        if size == 0:
            return None
        if option == "--json" and path.name in MODEL_JSON_FILES:
            return f"is a model folder's {path.name}, not {report}"
        if option == "--json" and size > REPORT_LIMIT_BYTES:
            return f"is {size:,} bytes, larger than a report ({REPORT_LIMIT_BYTES >> 20} MiB at most)"
        with open(path, "rb") as f:
            if option == "--plot":
                return None if f.read(len(PNG_SIGNATURE)) == PNG_SIGNATURE else f"is not {report}"
            value = json.loads(f.read().decode("utf-8"))
        if report_key is not None and not (isinstance(value, dict) and report_key in value):
            return f"is JSON but not an earlier report of this command (no top-level key {report_key!r})"
        return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    except (ValueError, RecursionError):  # not UTF-8, not JSON
        return f"is not {report}"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise GemmaExportError("--plot needs matplotlib: pip install matplotlib") from exc
    return plt


def write_plot(results: Sequence[BenchResult], path: str | Path, labels: Sequence[str] | None = None,
               before_rename: Callable[[], None] | None = None) -> None:
    """ms/token against context length, one line per result (needs matplotlib).

    Written whole or not at all, as :func:`write_json`: a temporary file beside ``path`` is renamed
    over it.

    Args:
        results: the runs to draw.
        path: the image file (its suffix names the format: ``.png``).
        labels: a legend entry per result (default: each model folder's name).
        before_rename: called once the image is written in full, before it replaces ``path``; if it
            raises, ``path`` is left as it was (``bench --json J --plot P`` writes J there: both
            files or neither, where the image's own write is the one likelier to fail).

    Raises:
        GemmaExportError: matplotlib is not installed.
        OutputError: the file cannot be written (full disk, permissions), naming it.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(results):
        xs, ys = zip(*r.decode_curve)
        ax.plot(xs, ys, ".", markersize=3, label=labels[i] if labels else Path(r.model).name)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode ms/token")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    try:
        write_whole_file(path, lambda temporary: fig.savefig(temporary, dpi=120, format=path.suffix[1:] or "png"), "--plot",
                     before_rename)
    finally:
        plt.close(fig)


def write_whole_file(path: Path, write: Callable[[Path], None], option: str,
                     before_rename: Callable[[], None] | None = None) -> None:
    """``write`` a temporary file beside ``path`` (beside the file a symbolic link names, so the
    link stays), call ``before_rename`` if given, then rename it over ``path``: whole or not at all.
    Whatever stops it (a full disk, Ctrl-C, ``before_rename`` raising) removes the temporary file.

    Raises:
        OutputError: an ``OSError`` while writing, naming ``option`` and the file.
    """
    from .errors import OutputError
    from .staging import hidden_prefix

    if path.is_symlink():  # replace the file the link names, not the link
        path = Path(os.path.realpath(path))
    # ".NAME.tmp-PID", NAME shortened as the hidden folders beside an output are: a legal name of
    # 246-255 bytes made the temporary name too long, and the report failed after all the work
    prefix = f"{hidden_prefix(path)}tmp-"
    _remove_dead_temporaries(path.parent, prefix)
    temporary = path.with_name(f"{prefix}{os.getpid()}")
    ours = True  # False while before_rename runs: its errors name its own file, not this one
    try:
        write(temporary)
        if before_rename is not None:
            ours = False
            before_rename()
            ours = True
        os.replace(temporary, path)
    except BaseException as exc:
        temporary.unlink(missing_ok=True)
        if ours and isinstance(exc, OSError):
            raise OutputError(f"{option} {path}: cannot write: {exc.strerror or exc}") from None
        raise


def _remove_dead_temporaries(folder: Path, prefix: str) -> None:
    """Delete ``{prefix}PID`` files in ``folder`` whose process no longer runs here and that were not
    modified for :data:`~gemma_export.staging.STALE_AFTER_SECONDS`: what a writer killed by SIGKILL
    between its write and its rename left (the next write of the same file removes it, as an output
    folder's next writer removes a killed one's staging folder). The age spares a live writer whose
    PID this host cannot see (a shared folder written from a container or another host)."""
    from .staging import STALE_AFTER_SECONDS

    try:
        names = [entry.name for entry in os.scandir(folder) if entry.name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # no such process: a leftover, once old enough
            with contextlib.suppress(OSError):
                info = os.lstat(folder / name)
                if stat.S_ISREG(info.st_mode) and time.time() - info.st_mtime > STALE_AFTER_SECONDS:
                    (folder / name).unlink()
        except (PermissionError, OverflowError, OSError):  # another user's live process, or no valid pid
            pass


def write_json(data: dict, path: str | Path | None) -> None:
    """Write ``data`` as indented JSON to ``path`` (None or :func:`to_stdout`: stdout), whole or not at all: a
    temporary file beside it is renamed over it (over the file a symbolic link names, so the link
    stays). Devices, FIFOs and anything under ``/dev`` or ``/proc`` are written in place, appended
    to (``--json /dev/stderr 2>>log`` keeps the log's earlier lines); a FIFO only when a process
    reads it already (its open does not wait for one).

    Raises:
        OutputError: the file cannot be written (full disk, permissions, a FIFO nothing reads), naming it.
    """
    from .errors import OutputError

    text = json.dumps(data, indent=2) + "\n"
    if path is None or to_stdout(path):
        sys.stdout.write(text)
        sys.stdout.flush()  # here, where a failure is reported, not at exit
        return
    path = Path(path)
    if _under_dev_or_proc(path) or (path.exists() and not path.is_file()):
        # a device, a FIFO or a descriptor (/dev/full, /dev/stderr, /proc/self/fd/2, even when it leads to
        # a regular file): written in place, never replaced by a regular file, and appended to (opening
        # it for writing would truncate a log that stderr leads to, e.g. `2>>log`). A named pipe is
        # opened without waiting: with no reader, a plain open blocked for ever after the whole run.
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
        except OSError as exc:
            try:
                fifo = stat.S_ISFIFO(os.stat(path).st_mode)
            except OSError:
                fifo = False
            if exc.errno == errno.ENXIO and fifo:  # ENXIO from a socket is its own matter
                raise OutputError(f"--json {path}: a named pipe that no process reads; the report was not written "
                                  f"(start its reader first, e.g. `cat {path} &`)") from None
            raise OutputError(f"--json {path}: cannot write: {exc.strerror or exc}") from None
        try:
            with open(fd, "a", encoding="utf-8") as f:  # owns fd from here
                os.set_blocking(fd, True)  # the reader takes the report at its own pace
                f.write(text)
        except OSError as exc:
            raise OutputError(f"--json {path}: cannot write: {exc.strerror or exc}") from None
        return
    write_whole_file(path, lambda temporary: temporary.write_text(text, encoding="utf-8"), "--json")
