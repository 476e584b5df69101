"""The examples' guard: run without the extra it needs, an example prints one paragraph with the install command and
exits 2, instead of a ``ModuleNotFoundError`` traceback. Imports nothing beyond the standard library, so it runs
before the imports it protects."""

import importlib.util
import sys
from pathlib import Path


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # a parent package is missing (``megatron`` for ``megatron.core``)
        return True


def require_extra(extra: str, *modules: str) -> None:
    """Exit with code 2 and one paragraph naming the install command when any of ``modules`` is not installed.

    Args:
        extra: the project's extra that installs them (``pip install -e ".[EXTRA]"``).
        modules: the modules the example imports from that extra (``megatron.core``, ``trl``).
    """
    missing = [module for module in modules if _missing(module)]
    if missing:
        script = Path(sys.argv[0]).name
        print(f"{script} needs the `{extra}` extra, which is not installed here (no module "
              f"{', '.join(repr(m) for m in missing)}). Install it from the repository root with "
              f"`pip install -e \".[{extra}]\"` and run `python examples/{script}` again; the other examples and "
              f"their extras are listed in docs/examples.md.", file=sys.stderr)
        sys.exit(2)
