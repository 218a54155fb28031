"""The leaves every capability uses: settings, once-logging, per-provider caches, the SDK's
private state read in one place, export checks, the exit flush, the status line, and the one
patch helper. Nothing here imports the capabilities above it (``scripts/import_graph.py``)."""
