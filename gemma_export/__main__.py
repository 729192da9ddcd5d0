"""``python -m gemma_export``: the ``gemma-export`` command (:func:`gemma_export.console.main`)."""

from .console import main

main()
