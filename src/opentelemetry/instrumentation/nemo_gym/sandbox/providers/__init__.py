"""Sandbox providers: the protocol and the bundled real implementations."""
