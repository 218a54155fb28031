"""NeMo Gym 0.6+'s ``nemo_gym.telemetry``, as far as the resource goes (``setup``)."""
