"""NeMo Gym: ``ServerClient`` requests labelled by target server, every provider its
``create_provider`` builds traced, its identity and whether its own telemetry records. Nothing
here imports NeMo Gym. (The ``nemo-gym-otel`` subcommands for NeMo Gym are in ``tools``.)"""
