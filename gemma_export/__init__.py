"""gemma-export: Gemma 3 / FunctionGemma-270M to ONNX with one shared tied-embedding table.

Python API (each command of the CLI, with typed results)::

    from gemma_export import export, generate
    result = export(dtype="int8")                  # bundled real Gemma 3 270M → ./gemma-3-270m-onnx-int8
    print(generate(result.out_dir, "The capital of France is", max_new_tokens=16).text)

    from gemma_export import inspect_path, run_parity, run_quality, run_bench, write_bundle
    inspect_path(result.out_dir).duplicates        # [] : the table is stored once
    run_parity(result.out_dir, against_transformers=True).passed
    run_quality(result.out_dir, tokens=512).metrics.kl_mean   # nats/token against transformers fp32
    run_bench(result.out_dir, board="sl2610").decode_ms_median
    write_bundle(result.out_dir, "board-folder")   # what `gemma-export bundle` writes

Every error raised on bad input is a :class:`GemmaExportError` (subclasses below); the CLI prints
its message on one line and exits with status 2. An argument of the wrong type is named by its
keyword (``export(): block_size must be an int, found str '32'``); a value out of range or two
arguments that conflict are :class:`ConfigError` too, but named as the command line names them
(``--block-size 24: must be a power of two >= 16``): the option ``--x-y`` is the keyword ``x_y``,
``--hadamard`` is ``hadamard_size``, ``--no-calibrate`` is ``calibrate=False``, ``--asymmetric``
is ``symmetric=False`` and ``--against transformers`` is ``against_transformers=True``.

Importing the package sets ``ORT_DISABLE_TELEMETRY=1`` in the process's environment when it is not
set (onnxruntime's telemetry off), so import it before onnxruntime.
"""

import os as _os

__version__ = "0.1.0"

# onnxruntime 1.29 and newer on Linux send usage telemetry to Microsoft and keep a device id and an
# event cache under ~/.cache/Microsoft (3 MB here after a day of runs) unless this variable is set
# before onnxruntime is first imported. A board with a small flash and no business calling out
# should do neither: the toolkit turns it off for its own process (and the processes it starts),
# and keeps a value the user set (ORT_DISABLE_TELEMETRY=0 leaves onnxruntime's default).
_os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

#: public name → (module, attribute): imported on first use, so that ``gemma-export --help`` and
#: ``import gemma_export`` stay fast (the quantizers and onnxruntime load only when needed)
_PUBLIC = {
    # the commands
    "export": ("exporter", "export"),
    "generate": ("runtime", "generate"),
    "open_source": ("sources", "open_source"),
    "inspect_path": ("inspect", "inspect_path"),
    "run_parity": ("parity", "run_parity"),
    "run_quality": ("quality", "run_quality"),
    "run_bench": ("bench", "run_bench"),
    "write_bundle": ("bundle", "write_bundle"),
    "verify_bundle": ("bundle", "verify_bundle"),
    "verify_manifest": ("verify", "verify_manifest"),
    # their results
    "ExportResult": ("exporter", "ExportResult"),
    "GenerationResult": ("runtime", "GenerationResult"),
    "Checkpoint": ("checkpoint", "Checkpoint"),
    "Report": ("inspect", "Report"),
    "ParityReport": ("parity", "ParityReport"),
    "QualityReport": ("quality", "QualityReport"),
    "BenchResult": ("bench", "BenchResult"),
    "BundleResult": ("bundle", "BundleResult"),
    # the errors
    **{name: ("errors", name) for name in ("GemmaExportError", "ConfigError", "FormatError", "NumericError",
                                            "SourceNotFoundError", "OutputError", "VerificationError",
                                            "ResourceError", "BudgetExceeded")},
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'gemma_export' has no attribute {name!r}")
    import importlib

    module, attribute = _PUBLIC[name]
    return getattr(importlib.import_module(f".{module}", __name__), attribute)


def __dir__():
    return sorted(set(globals()) | set(__all__))
