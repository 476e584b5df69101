"""Importing the installed ``alpaca_eval`` package.

* Our package is called ``eval`` and this subpackage ``eval.alpaca`` (not ``alpaca_eval``) so that
  ``import alpaca_eval`` always resolves to the installed package (site-packages), never to our code.
* alpaca_eval 0.6.x imports ``pkg_resources`` (for ``parse_version`` / ``get_distribution``), which
  setuptools >= 81 no longer ships. When it is missing, a two-function stand-in built on ``packaging`` and
  ``importlib.metadata`` is registered under that name while alpaca_eval is imported, and removed again
  afterwards. (The durable fix is ``setuptools<81`` in the eval environment, or a newer alpaca_eval.)
"""

from __future__ import annotations

import importlib
import sys
import types


def _install_pkg_resources_shim() -> bool:
    try:
        import pkg_resources  # noqa: F401

        return False
    except ImportError:
        pass
    from importlib import metadata

    from packaging.version import parse as parse_version

    shim = types.ModuleType("pkg_resources")
    shim.__doc__ = "Minimal stand-in installed by eval.alpaca.compat (parse_version, get_distribution)."

    class _Distribution:
        def __init__(self, name: str):
            self.project_name = name
            self.version = metadata.version(name)

    shim.parse_version = parse_version
    shim.get_distribution = _Distribution
    shim.DistributionNotFound = metadata.PackageNotFoundError
    shim._hl_shim = True
    sys.modules["pkg_resources"] = shim
    return True


def import_alpaca_eval():
    """The installed ``alpaca_eval`` module (with ``alpaca_eval.main`` and ``alpaca_eval.metrics`` loaded)."""
    installed = _install_pkg_resources_shim()
    try:
        module = importlib.import_module("alpaca_eval")
        importlib.import_module("alpaca_eval.main")
        importlib.import_module("alpaca_eval.metrics")
    finally:
        # alpaca_eval.utils keeps its own reference; do not leave a partial `pkg_resources` visible to other
        # libraries that probe for the real one with `try: import pkg_resources`.
        if installed and getattr(sys.modules.get("pkg_resources"), "_hl_shim", False):
            del sys.modules["pkg_resources"]
    return module
