"""NeMo Gym: ``ServerClient`` requests labelled by target server, every provider its
``create_provider`` builds traced, its identity and whether its own telemetry records, and the
server virtualenvs of ``nemo-gym-otel server-venvs``. Nothing here imports NeMo Gym."""
