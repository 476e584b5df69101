"""No function over 80 lines in ``hl_core``, ``launchers`` and ``eval``: a function reads in one screen (counted from
its ``def`` line to its last line, docstring and comments included; nested functions count inside their parent and
on their own)."""

import ast
from pathlib import Path
from typing import List

from helpers import REPO

MAX_FUNCTION_LINES = 80
PACKAGES = ("hl_core", "launchers", "eval")


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> List[str]:
    """``path:line name (N lines)`` of every function longer than ``limit`` lines under ``root``'s packages."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_over_80_lines():
    found = long_functions(REPO)
    assert not found, ("functions over 80 lines (split them by what each part decides):\n" + "\n".join(found))


def test_the_check_counts_a_long_function_and_passes_a_short_one(tmp_path):
    (tmp_path / "hl_core").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    (tmp_path / "hl_core" / "fits.py").write_text(f"def fits():\n{body}")
    (tmp_path / "hl_core" / "long.py").write_text(f"class C:\n    async def long(self):\n{body}        pass\n"
                                                  .replace("\n    x", "\n        x"))
    assert long_functions(tmp_path) == [f"hl_core/long.py:2 long ({MAX_FUNCTION_LINES + 1} lines)"]
