"""The private APIs of our dependencies that we rely on, one module per dependency.

Each module reaches into its library in one place and checks at import that what it reaches
for is there: an upgrade that removed it fails at start-up with the library's name and the
range we pin, not later with an ``AttributeError`` in a hot path. ``tests/sidecar_runtime/
test_compat.py`` holds each one's behaviour on the versions pyproject.toml pins.
"""
