"""The tools a user runs: the ``nemo-gym-otel`` command (``cli``) and what its subcommands do
(``capacity``, ``server-venvs``, ``stub-model``, ``report``). Nothing here is loaded by the
instrumentation; a tool may use any part of the package."""
