"""Hooks into libraries the plugin never imports itself, each in a package of its own."""
