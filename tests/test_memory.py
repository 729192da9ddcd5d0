"""``gemma_export.memory``: the huge-page move of onnxruntime's heap-packed weights."""

from __future__ import annotations

import platform

import numpy as np
import pytest

from gemma_export import memory
from gemma_export.runtime import OnnxDecoder

MIB = 1 << 20

MAPS = """\
55d4c8a00000-55d4c8e00000 rw-p 00000000 00:00 0                          [heap]
7f0000100000-7f0000a00000 rw-p 00000000 00:00 0 
7f0000a00000-7f0000b00000 rw-p 00000000 00:00 0 
7f0000c00000-7f0001000000 r--p 00000000 00:00 0 
7f0001000000-7f0001400000 rw-s 00000000 00:05 12                         /dev/zero (deleted)
7f0002000000-7f0002800000 rw-p 00001000 fd:01 4242                       /data/model.onnx.data
7ffd1c000000-7ffd1c800000 rw-p 00000000 00:00 0                          [stack]
"""


def test_anonymous_huge_ranges_keeps_whole_aligned_huge_pages_of_private_writable_anonymous_memory():
    ranges = memory.anonymous_huge_ranges(MAPS, 2 * MIB)
    assert ranges == [
        (0x55d4c8a00000, 0x55d4c8e00000),  # [heap], already aligned: 2 huge pages
        (0x7f0000200000, 0x7f0000a00000),  # 1 MiB .. 10 MiB rounded inwards to 2 .. 10 MiB
    ]  # 1 MiB mapping: no whole huge page; read-only, shared, file-backed and the stack: left out



def test_anonymous_huge_ranges_leaves_out_shared_and_file_backed_mappings_without_a_path():
    # the private flag and the inode are checked themselves, not only through the path: a shared
    # anonymous mapping and one of a file with no path shown (inode 77) hold no private heap
    maps = (
        "7f0000000000-7f0000400000 rw-s 00000000 00:00 0 \n"
        "7f0000400000-7f0000800000 rw-p 00000000 fd:01 77 \n"
        "7f0000800000-7f0000c00000 rw-p 00000000 00:00 0 \n"
    )
    assert memory.anonymous_huge_ranges(maps, 2 * MIB) == [(0x7f0000800000, 0x7f0000c00000)]


def test_kb_fields_are_read_in_bytes_of_1024(tmp_path):
    # /proc's "kB" are KiB: 1,000 of them are 1,024,000 bytes; lines without a kB unit are skipped
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t    1000 kB\nRss:  7 kB\nThreads:\t4\nHugePages_Total:       0\n")
    assert memory._kb_fields(str(status)) == {"VmHWM": 1_024_000, "Rss": 7168}
    assert memory._kb_fields(str(tmp_path / "missing")) == {}


def _kernel_collapses() -> str | None:
    """Why this machine cannot collapse (None when it can): Linux >= 6.1 with THP not 'never'."""
    if platform.system() != "Linux" or not memory.HPAGE_PMD_SIZE_FILE.exists():
        return "no transparent huge pages here"
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    if "[never]" in mode:
        return "transparent huge pages are set to never"
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return None if (major, minor) >= (6, 1) else f"MADV_COLLAPSE needs Linux >= 6.1, found {platform.release()}"


def _anon_huge_pages_of(address: int, field: str = "AnonHugePages") -> int:
    """``AnonHugePages`` (or another ``field``, bytes) of the mapping holding ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == f"{field}:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(_kernel_collapses() is not None, reason=str(_kernel_collapses()))
def test_collapse_moves_touched_anonymous_memory_onto_huge_pages_and_keeps_it():
    import ctypes
    import mmap

    size = 64 * MIB  # private anonymous, as onnxruntime's allocations; nobody asked for huge pages
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pattern = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    region[:] = pattern.tobytes()  # every small page touched
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    before = _anon_huge_pages_of(address)
    assert before <= 16 * MIB
    moved = memory.collapse_to_huge_pages()
    assert moved >= 48 * MIB - before  # the process total grew by at least this mapping's part
    assert _anon_huge_pages_of(address) >= 62 * MIB  # all of it but one unaligned huge page at most
    assert np.array_equal(np.frombuffer(region, np.uint8), pattern)


@pytest.mark.skipif(_kernel_collapses() is not None, reason=str(_kernel_collapses()))
def test_collapse_leaves_partly_used_huge_pages_alone():
    """A huge page whose small pages are not all resident is not collapsed: collapsing would fill
    its holes (on the int8 270M, 28 MB more Anonymous memory for no speed)."""
    import ctypes
    import mmap

    if "[always]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read():
        pytest.skip("THP 'always' gives huge pages at the first touch; nothing is left for collapse to decide")
    size = 32 * MIB
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for offset in range(0, size, 64 * 1024):  # one small page in sixteen touched
        region[offset] = 1
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    before, huge_before = _anon_huge_pages_of(address, "Rss"), _anon_huge_pages_of(address)
    # mostly small pages: a few may come as huge pages at the first touch, depending on what the
    # process mapped before (2 of 16 seen when more test modules were imported first)
    assert before <= size // 4
    memory.collapse_to_huge_pages()
    assert _anon_huge_pages_of(address, "Rss") == before  # nothing filled in
    assert _anon_huge_pages_of(address) == huge_before  # no partly used huge page collapsed


def test_collapse_is_a_no_op_without_the_huge_page_switch(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "HPAGE_PMD_SIZE_FILE", tmp_path / "missing")
    assert memory.collapse_to_huge_pages() == 0


def test_decoder_on_huge_pages_gives_identical_logits(tiny_int8_export, monkeypatch):
    calls, collapse = [], memory.collapse_to_huge_pages

    def spy():  # the real collapse, counted: the decoder must call it once, after session creation
        calls.append(collapse())
        return calls[-1]

    ids = np.arange(3, 15, dtype=np.int64)[None]
    feeds = (ids, np.ones_like(ids), np.arange(ids.shape[1])[None])
    monkeypatch.setattr(memory, "collapse_to_huge_pages", spy)
    plain = OnnxDecoder(tiny_int8_export, prepacked=False, huge_pages=False)
    assert plain.huge_page_bytes == 0 and calls == []
    logits = plain.forward(*feeds, plain.empty_cache(1))[0]
    huge = OnnxDecoder(tiny_int8_export, prepacked=False)
    assert len(calls) == 1 and huge.huge_page_bytes == calls[0]  # what moved is what the decoder reports
    assert np.array_equal(huge.forward(*feeds, huge.empty_cache(1))[0], logits)


# The board's process holds only what it needs. Generation: the graph builder's onnx_ir (and the
# checkpoint readers) cost ~30 MB of anonymous memory there (docs/benchmarks-history.md). verify, prepack and
# a bundle's check run there too: importing the exporter for its checks cost 49 MB (onnx_ir, the
# builder, the quantizers, calibration).
@pytest.mark.parametrize("run, unwanted", [
    ("from gemma_export.runtime import OnnxDecoder\nd = OnnxDecoder(sys.argv[1])\n"
     "assert d.sliding_layers, 'the tiny export has sliding layers'\nd.greedy([2, 40, 41], 3)",
     ("onnx_ir", "gguf", "safetensors", "gemma_export.builder", "gemma_export.checkpoint")),
    ("from gemma_export.verify import verify_manifest\nassert 'model.onnx' in verify_manifest(sys.argv[1])",
     ("onnx_ir", "gemma_export.builder", "gemma_export.weights", "gemma_export.calibration", "gemma_export.exporter",
      "quant")),
], ids=["generate", "verify"])
def test_the_board_commands_do_not_import_the_graph_builder(tiny_int8_export, run, unwanted):
    import subprocess
    import sys

    code = f"import sys\n{run}\nprint(sorted(m for m in sys.modules if m in {unwanted!r}))"
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_int8_export)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_decoder_gives_heap_freed_while_loading_back_to_the_kernel(tiny_int8_export):
    # Loading (the graph, the tokenizer, onnxruntime's transient buffers) frees heap that glibc keeps
    # while a later block pins the top of the heap: ~180 MB of Anonymous memory on the real int8
    # export from its pre-packed copy, held for the whole run. Here 200 MB of small malloc blocks
    # below a pinned one are freed just before the decoder is created, in a fresh process.
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    code = (
        "import ctypes, sys\n"
        "from gemma_export.memory import snapshot\n"
        "from gemma_export.runtime import OnnxDecoder\n"
        "libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p; libc.free.argtypes = [ctypes.c_void_p]\n"
        "libc.malloc.argtypes = [ctypes.c_size_t]\n"
        "blocks = [libc.malloc(4096) for _ in range(50_001)]\n"
        "for b in blocks: ctypes.memset(b, 1, 4096)\n"
        "for b in blocks[:-1]: libc.free(b)\n"  # the last one pins the top of the heap
        "held = snapshot().anonymous_bytes // 1024\n"
        "OnnxDecoder(sys.argv[1], prepacked=False, huge_pages=False)\n"
        "print(held, snapshot().anonymous_bytes // 1024)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_int8_export)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    held_kb, after_kb = map(int, proc.stdout.split())
    assert held_kb - after_kb > 150_000, (held_kb, after_kb)  # the freed 200 MB went back, less what loading kept


def test_the_first_decode_step_after_a_prompt_gives_the_prompts_activation_memory_back(tiny_int8_export, tmp_path):
    # A prompt in one step of 2,048 tokens makes onnxruntime's arena hold the step's activations
    # (attention scores alone: 4 heads x 2,048^2 float32 = 64 MB); once decoding, none of it is in
    # use. The first decode step after the prompt shrinks the arena and trims the heap, in a fresh
    # process; a step of the same prompt without that release keeps it.
    import subprocess
    import sys

    from conftest import export_with_config

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    long = export_with_config(tiny_int8_export, tmp_path / "long", max_position_embeddings=4096)
    code = (
        "import sys\n"
        "from gemma_export import runtime\n"
        "from gemma_export.memory import release_free_heap, snapshot\n"
        "decoder = runtime.OnnxDecoder(sys.argv[1], threads=1, prepacked=False, huge_pages=False)\n"
        "if sys.argv[2] == 'kept':\n"
        "    runtime._arena_shrinkage = lambda: None\n"  # run_with_iobinding(b, None): the default options
        "release_free_heap(); before = snapshot().anonymous_bytes\n"
        "ids, _, steps = decoder.greedy([1] + [5 + i % 80 for i in range(2047)], 3, stop_ids=[], prefill_chunk=None)\n"
        "assert len(ids) == 3 and len(steps) == 2, (ids, steps)\n"
        "print((snapshot().anonymous_bytes - before) // 1024)\n")
    grown = {}
    for mode in ("released", "kept"):
        proc = subprocess.run([sys.executable, "-c", code, str(long), mode], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        grown[mode] = int(proc.stdout)
    assert grown["kept"] > 60_000, grown  # the prompt's activations, held
    assert grown["released"] < grown["kept"] - 50_000, grown  # given back after the prompt


def test_the_heap_trim_looks_libc_up_once(monkeypatch):
    # ctypes.util.find_library runs `ldconfig -p` in a subprocess (several ms); the first decode step
    # after every prompt trims the heap, so the lookup is made once per process
    import ctypes.util

    from gemma_export.memory import release_free_heap

    release_free_heap()

    def no_lookup(name):
        raise AssertionError("find_library called again")

    monkeypatch.setattr(ctypes.util, "find_library", no_lookup)
    release_free_heap()
    release_free_heap()


def test_snapshots_subtract_field_by_field():
    assert memory.MemorySnapshot(10, 4) - memory.MemorySnapshot(3, 1) == memory.MemorySnapshot(7, 3)


def test_available_memory_is_memavailable_not_memfree(monkeypatch):
    """MemFree leaves out the page cache the kernel can drop; the KV-cache check needs MemAvailable."""
    monkeypatch.setattr(memory, "_kb_fields", lambda path: {"MemFree": 1 << 20, "MemAvailable": 5 << 30}
                        if path == "/proc/meminfo" else {})
    assert memory.available_bytes() == 5 << 30


def test_peak_resident_memory_remembers_what_was_freed():
    """VmHWM, not the current VmRSS: 200 MB touched and freed in a fresh process stay in the peak."""
    import subprocess
    import sys

    code = ("import numpy as np\nfrom gemma_export import memory\na = np.ones(25_000_000)\ndel a\n"
            "print(memory.peak_rss_bytes() - memory.snapshot().rss_bytes)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert int(done.stdout) >= 150_000_000, done.stderr


def test_a_kv_buffer_is_anonymous_memory_once_written_and_none_once_freed():
    """A KV-cache buffer (``runtime.kv_buffer``) takes memory as its rows are written, counts as
    Anonymous (a shared map would be shmem: Rss only), and goes back to the kernel when freed,
    without a heap trim. The case where a heap array would not: glibc's mmap threshold raised by
    freeing a 24 MiB array, then an 8 MiB buffer (``np.empty`` left 7.7 MiB in the heap). A fresh
    process, so that no earlier test's heap is reused; huge pages off for the map, so that a quarter
    written is a quarter resident."""
    import json
    import subprocess
    import sys

    if memory.snapshot().anonymous_bytes == 0:
        pytest.skip("no /proc/self/smaps_rollup here")
    code = """
import json, mmap
import numpy as np
from gemma_export import memory
from gemma_export.runtime import kv_buffer
big = np.ones(3 << 20)  # 24 MiB: glibc maps it apart, and freeing it raises its mmap threshold
big[::512] = 2.0
del big
before = memory.snapshot()
buffer = kv_buffer((1, 2, 1024, 1024))  # 8 MiB of float32
region = buffer
while isinstance(region, np.ndarray):
    region = region.base
region = region.obj if isinstance(region, memoryview) else region
if isinstance(region, mmap.mmap) and hasattr(mmap, "MADV_NOHUGEPAGE"):
    region.madvise(mmap.MADV_NOHUGEPAGE)
del region
facts = [list(buffer.shape), str(buffer.dtype), buffer.flags.writeable, bool(buffer.any())]
buffer[:, :, :256] = 1.0  # a quarter of the rows written
quarter = memory.snapshot() - before
buffer[...] = 1.0
whole = memory.snapshot() - before
del buffer
freed = memory.snapshot() - before
print(json.dumps([facts, quarter.anonymous_bytes, whole.anonymous_bytes, whole.rss_bytes, freed.anonymous_bytes]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    facts, quarter, whole, whole_rss, freed = json.loads(done.stdout)
    assert facts == [[1, 2, 1024, 1024], "float32", True, False]  # writeable and zero-filled
    assert 1.5 * MIB < quarter < 3 * MIB, quarter
    assert whole > 7.5 * MIB and whole_rss > 7.5 * MIB, (whole, whole_rss)
    assert freed < 1 * MIB, freed


# Mutation review (thirteenth session)

def test_a_snapshot_reads_rss_and_anonymous_into_their_own_fields(monkeypatch):
    monkeypatch.setattr(memory, "_kb_fields", lambda path: {"Rss": 3072, "Anonymous": 2048})
    assert memory.snapshot() == memory.MemorySnapshot(rss_bytes=3072, anonymous_bytes=2048)


def test_this_process_has_more_rss_than_anonymous_memory():
    snapshot = memory.snapshot()
    assert snapshot.rss_bytes > snapshot.anonymous_bytes > 0


def test_collapsing_never_reports_a_negative_growth(monkeypatch, tmp_path):
    size = tmp_path / "hpage_pmd_size"
    size.write_text("2097152\n")
    monkeypatch.setattr(memory, "HPAGE_PMD_SIZE_FILE", size)
    monkeypatch.setattr(memory, "anonymous_huge_ranges", lambda maps, huge: [])
    values = iter([4 << 20, 2 << 20])  # AnonHugePages shrank meanwhile (khugepaged, a free)
    monkeypatch.setattr(memory, "_kb_fields", lambda path: {"AnonHugePages": next(values)})
    assert memory.collapse_to_huge_pages() == 0


def test_sessions_keep_no_memory_pattern_per_decode_step(tiny_int8_export):
    """onnxruntime keeps a memory pattern per set of input shapes for a session's life, and each
    decode step's attention_mask is one longer than the last: with patterns on, the heap in use
    grew by ~3.5 KB a step on the tiny export (3.4 KB on the real int8 one). The sessions this
    toolkit creates have them off; the same steps with them forced on show what is measured."""
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallinfo2 is glibc's")
    code = (
        "import ctypes, sys\n"
        "import numpy as np\n"
        "import onnxruntime as ort\n"
        "from gemma_export import runtime\n"
        "class Info(ctypes.Structure):\n"
        "    _fields_ = [(n, ctypes.c_size_t) for n in 'arena ordblks smblks hblks hblkhd usmblks fsmblks "
        "uordblks fordblks keepcost'.split()]\n"
        "libc = ctypes.CDLL('libc.so.6')\n"
        "if not hasattr(libc, 'mallinfo2'):\n"
        "    print('skip'); sys.exit(0)\n"
        "libc.mallinfo2.restype = Info\n"
        "if sys.argv[2] == 'forced':\n"
        "    real = ort.SessionOptions\n"
        "    class Forced(real):\n"
        "        enable_mem_pattern = property(lambda self: True, lambda self, value: real.enable_mem_pattern.__set__(self, True))\n"
        "    ort.SessionOptions = Forced\n"
        "decoder = runtime.OnnxDecoder(sys.argv[1], threads=1, prepacked=False, huge_pages=False)\n"
        "print(decoder.session.get_session_options().enable_mem_pattern)\n"
        "cache = runtime.KVCache(decoder, 1, 400)\n"
        "marks = []\n"
        "for position in range(250):  # max_position_embeddings 256\n"
        "    cache.step(np.asarray([[5]]), np.ones((1, position + 1), np.int64), np.asarray([[position]]))\n"
        "    if position in (40, 240):\n"
        "        marks.append(libc.mallinfo2().uordblks)\n"
        "print(marks[1] - marks[0])\n")
    grown = {}
    for mode in ("ours", "forced"):
        proc = subprocess.run([sys.executable, "-c", code, str(tiny_int8_export), mode], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        if proc.stdout.strip() == "skip":
            pytest.skip("this glibc has no mallinfo2")
        pattern, growth = proc.stdout.split()
        assert pattern == str(mode == "forced"), proc.stdout
        grown[mode] = int(growth)
    assert grown["forced"] > 400_000, grown  # 200 steps × ~3.5 KB: the measurement sees the patterns
    assert grown["ours"] < 150_000, grown


def test_greedy_frees_the_prompts_logits_before_the_heap_trim(tiny_int8_export, monkeypatch):
    """The prompt step's logits are an array of their own (1 MB on the real 270M, or [1, S, vocab]);
    held until the next step returned, they were freed after that step's heap trim, and glibc kept
    the 1 MB (2026-12-07). ``greedy`` and ``greedy_batch`` drop them once the token is picked."""
    import weakref

    from gemma_export import runtime

    decoder = OnnxDecoder(tiny_int8_export)
    step, prompt_logits, alive_at_trim = runtime.KVCache.step, [], []

    def recording(self, input_ids, attention_mask, position_ids, out=None):
        logits = step(self, input_ids, attention_mask, position_ids, out)
        if input_ids.shape[1] > 1:
            prompt_logits.append(weakref.ref(logits))
        return logits

    monkeypatch.setattr(runtime.KVCache, "step", recording)
    monkeypatch.setattr(runtime, "release_free_heap",
                        lambda: alive_at_trim.append([ref() is not None for ref in prompt_logits]))
    decoder.greedy([2, 17, 33, 52, 8, 9], 4, stop_ids=[], prefill_chunk=4)  # two prompt steps
    assert len(prompt_logits) == 2 and alive_at_trim == [[False, False]], alive_at_trim
    prompt_logits.clear(), alive_at_trim.clear()
    decoder.greedy_batch([[2, 17, 33], [2, 40, 41, 42]], 3)
    assert len(prompt_logits) == 1 and alive_at_trim == [[False]], alive_at_trim
