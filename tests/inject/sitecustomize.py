"""Loaded by every Python process the test suite starts (tests/conftest.py puts this folder on PYTHONPATH): the
test hooks of :mod:`scaleattn_hooks`, configured by environment variables, installed from outside the package."""
import scaleattn_hooks

scaleattn_hooks.install()
