"""Sandbox resource telemetry: what each sandbox asked for, was allocated and used."""
