"""A stand-in ``nemo_gym`` package: only what NeMo Gym 0.6+ names its processes with (see
``telemetry/setup.py``). Put on ``PYTHONPATH`` by ``tests/test_names_mixed_fleet.py``."""
