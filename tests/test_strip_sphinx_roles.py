"""tools/strip_sphinx_roles.py: Sphinx roles and grouped arguments rewritten in docstrings only, idempotently; and
the tree has none left (the docs site renders Google-style docstrings, where a role shows as raw text)."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO
from tools import strip_sphinx_roles as strip  # noqa: E402

ROLE, FUNC, METH = ":" + "class:", ":" + "func:", ":" + "meth:"  # (split: this file's own text holds no role)

SOURCE = f'''"""Module: see {ROLE}`Thing` and {FUNC}`.sub.helper`, {METH}`~pkg.mod.Class.method`."""

MESSAGE = "{ROLE}`kept` in an ordinary string"  # and {FUNC}`kept` in a comment


def f(a, b, policy_logps, ref_logps):
    """One line.

    Args:
        a, b: the Beta parameters (``> 0``),
            on two lines.
        policy_logps, ref_logps (Tensor): per-token log-probs.

    Returns:
        ``x``, as {ROLE}`Result`.
    """
    return make(doc="""Made by {FUNC}`make`.""")
'''

EXPECTED = f'''"""Module: see `Thing` and `sub.helper`, `method`."""

MESSAGE = "{ROLE}`kept` in an ordinary string"  # and {FUNC}`kept` in a comment


def f(a, b, policy_logps, ref_logps):
    """One line.

    Args:
        a: the Beta parameters (``> 0``),
            on two lines.
        b: the Beta parameters (``> 0``),
            on two lines.
        policy_logps (Tensor): per-token log-probs.
        ref_logps (Tensor): per-token log-probs.

    Returns:
        ``x``, as `Result`.
    """
    return make(doc="""Made by `make`.""")
'''


def test_roles_and_grouped_arguments_are_rewritten_in_docstrings_only():
    assert strip.convert_source(SOURCE) == EXPECTED


def test_a_second_run_changes_nothing():
    assert strip.convert_source(EXPECTED) == EXPECTED


def test_the_check_mode_reports_a_file_that_would_change(tmp_path):
    (tmp_path / "m.py").write_text(SOURCE)
    tool = [sys.executable, str(REPO / "tools" / "strip_sphinx_roles.py")]
    check = subprocess.run([*tool, "--check", str(tmp_path)], capture_output=True, text=True)
    assert check.returncode == 1 and "m.py" in check.stdout and (tmp_path / "m.py").read_text() == SOURCE
    assert subprocess.run([*tool, str(tmp_path)], capture_output=True, text=True).returncode == 0
    assert (tmp_path / "m.py").read_text() == EXPECTED
    assert subprocess.run([*tool, "--check", str(tmp_path)], capture_output=True, text=True).returncode == 0


def test_no_docstring_in_the_tree_has_a_sphinx_role():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "strip_sphinx_roles.py"), "--check", str(REPO)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"run `python tools/strip_sphinx_roles.py`; it would change:\n{proc.stdout}"
