"""OpenTelemetry instrumentation for RL-environment infrastructure (work in progress)."""
