"""``python -m gemma_export``: the ``gemma-export`` command (:func:`gemma_export.console.main`)."""

from .console import main

if __name__ == "__main__":  # importing the module (pydoc, autodoc) runs nothing
    main()
