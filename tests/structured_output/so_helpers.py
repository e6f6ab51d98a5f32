"""Shared pieces of the structured-output tests: the real-server helper."""

from __future__ import annotations

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "axon_tests_server_conftest", os.path.join(os.path.dirname(__file__), "..", "server", "conftest.py")
)
assert _spec is not None and _spec.loader is not None
_server_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_server_conftest)
ServerProcess = _server_conftest.ServerProcess
