"""The TRL quick starts run as written: the script of the quickstart's section 2 (``docs/quickstart.md``) and the
one of the TRL page (``docs/howto/trl.md``), each extracted from its page and run as a file in a folder where
``tests/`` is the repository's (the scripts read the tiny model and pairs from there), train 4 updates and print
one row each."""

import ast
import re
import subprocess
import sys

import pytest

from helpers import REPO, _env

pytest.importorskip("trl")
PAGES = {"quickstart": (REPO / "docs" / "quickstart.md", "## 2. TRL's trainers"),
         "trl page": (REPO / "docs" / "howto" / "trl.md", "## Quick start")}


def script(page, heading) -> str:
    """The first Python block after ``heading`` on ``page``."""
    text = page.read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("name", list(PAGES))
def test_the_quick_start_runs_as_written(name, tmp_path):
    source = script(*PAGES[name])
    ast.parse(source)  # a whole script, not a fragment
    (tmp_path / "tests").symlink_to(REPO / "tests")
    (tmp_path / "quick_start.py").write_text(source)
    proc = subprocess.run([sys.executable, "quick_start.py"], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [ast.literal_eval(line) for line in proc.stdout.splitlines() if line.startswith("{'update'")]
    assert [row["update"] for row in rows] == [0, 1, 2, 3] and all(row["synced"] for row in rows), proc.stdout
