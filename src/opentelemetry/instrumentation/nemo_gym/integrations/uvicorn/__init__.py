"""Hooks into uvicorn for tracing: each request it serves starts from an empty context."""
