"""gemma-export: Gemma 3 / FunctionGemma-270M to ONNX with one shared tied-embedding table.

Python API::

    from gemma_export import export, generate
    result = export(dtype="int8")                  # bundled real Gemma 3 270M → ./gemma-3-270m-onnx-int8
    print(generate(result.out_dir, "The capital of France is", max_new_tokens=16).text)
"""

__version__ = "0.1.0"

__all__ = ["export", "generate", "open_source", "__version__"]


def __getattr__(name):  # lazy: keep `gemma-export --help` fast
    if name == "export":
        from .exporter import export
        return export
    if name == "generate":
        from .runtime import generate
        return generate
    if name == "open_source":
        from .sources import open_source
        return open_source
    raise AttributeError(name)
