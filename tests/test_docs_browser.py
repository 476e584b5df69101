"""The docs site checked the way people read it (issue 47): `mkdocs build --strict`, then the home page, the quickstart,
the API pages and the own-loop page opened in headless Chromium (tools/docs_browser.py, CDP over a pipe). A page fails
on raw markup (a Sphinx role, a literal `**`, a list item run into its paragraph), a console error, a code block wider
than its column (in a 1440 x 900 window: about 118 characters of code), or a page of the site missing from the
navigation; the API pages must render argument tables.

Screenshots are CI artifacts: `site/_browser/<page>.png` under the build directory (`DOCS_BROWSER_SITE`, default
`build/docs-site/`, kept after the run). Skips, with the reason, only where Chromium is not installed
(`.ci/run` installs Debian's `chromium`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from capabilities import require
from helpers import REPO
from tools import docs_browser  # noqa: E402

PAGES = ["", "quickstart/", "reference/api/", "reference/humanline-api/", "howto/own-loop/", "examples/", "howto/trl/",
         "recipe-keys/", "concepts/callbacks/"]
API_PAGES = ["reference/api/", "reference/humanline-api/"]
BINARY = docs_browser.chromium_binary()
# a skip without chromium on the PATH; under CI=true a failure naming it (tests/capabilities.py)
needs_chromium = pytest.mark.usefixtures("chromium")


@pytest.fixture
def chromium():
    require("chromium", None if BINARY else "no chromium on the PATH (apt-get install -y chromium)")


def _build(docs_root: Path, site: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(docs_root)}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=docs_root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _problems(reports: dict, site: Path) -> dict:
    """Per page, what a reader would trip on (empty lists when the page reads cleanly)."""
    pages = {p.parent.relative_to(site).as_posix() for p in site.rglob("index.html")
             if not {"_browser", "assets", "search"} & set(p.relative_to(site).parts)}
    pages = {"" if page == "." else page for page in pages}
    problems = {}
    for page, report in reports.items():
        listed = {path.strip("/") for path in report["nav"]}
        found = {"raw markup": report["raw"], "list items run inline": report["inline_lists"],
                 "console errors": report["console"], "code wider than its column": report["wide_code"],
                 "code broken inside a token": report["broken_code"],
                 "pages missing from the navigation": sorted(p for p in pages if p.strip("/") not in listed)}
        if page in API_PAGES and report["argument_tables"] < 3:
            found["argument tables"] = [f"only {report['argument_tables']}"]
        problems[page] = {k: v for k, v in found.items() if v}
    return problems


@pytest.fixture(scope="module")
def site():
    """The site built with mkdocs --strict into ``DOCS_BROWSER_SITE`` (default build/docs-site); with
    ``DOCS_BROWSER_BUILT=1`` the site already there is used (.ci/docs.sh has just built it)."""
    site = Path(os.environ.get("DOCS_BROWSER_SITE", REPO / "build" / "docs-site"))
    if os.environ.get("DOCS_BROWSER_BUILT") == "1" and (site / "index.html").exists():
        return site
    shutil.rmtree(site, ignore_errors=True)
    _build(REPO, site)
    return site


@needs_chromium
def test_the_site_reads_cleanly_in_a_browser(site):
    reports = docs_browser.inspect_site(site, site / "_browser", PAGES, BINARY)
    assert all(Path(r["screenshot"]).stat().st_size > 10_000 for r in reports.values())
    problems = {page: found for page, found in _problems(reports, site).items() if found}
    assert problems == {}, f"{json.dumps(problems, indent=1)}\nscreenshots in {site / '_browser'}"


@needs_chromium
def test_the_browser_check_fails_on_a_planted_raw_role(tmp_path):
    """A copy of the docs whose API module gets a raw Sphinx class role and a literal double asterisk in a docstring,
    and whose home page gets a list run into its paragraph: the check names all three on the pages where they show."""
    copy = tmp_path / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", "build", "site", "runs", "__pycache__"))
    errors = copy / "hl_core" / "errors.py"
    source = errors.read_text()
    first = source.index('"""') + 3
    planted_role = "Planted: see " + ":" + "class:`HumanlineError` and ** not bold ** "
    errors.write_text(source[:first] + planted_role + source[first:])
    index = copy / "docs" / "index.md"
    index.write_text(index.read_text() + "\nA paragraph whose list did not start:\n- **refused** inline\n")
    _build(copy, tmp_path / "site")
    reports = docs_browser.inspect_site(tmp_path / "site", tmp_path / "shots", ["", "reference/api/"], BINARY)
    found = _problems(reports, tmp_path / "site")
    raw = " ".join(found["reference/api/"].get("raw markup", []))
    assert ":class:" in raw and "** not bold **" in raw
    assert any("refused" in item for item in found[""].get("list items run inline", []))


# ------------------------------------------------------------------------------------------- the Markdown hooks

from tools import docs_hooks  # noqa: E402


def test_github_style_list_items_keep_their_blocks():
    page = ("- **one.** text\n  more text:\n\n  | a | b |\n  |---|---|\n  | 1 | 2 |\n\n  after the table\n"
            "- **two** next item\n  its line\n\nA paragraph.\n")
    out = docs_hooks.widen_list_items(page)
    assert "\n    | a | b |\n" in out and "\n    after the table\n\n- **two** next item\n    its line\n" in out
    assert out.endswith("\n\nA paragraph.\n")
    tight = "- a\n  b\n- c\n"
    assert docs_hooks.widen_list_items(tight) == "- a\n    b\n- c\n"  # no blank lines put into a tight list
    assert docs_hooks.widen_list_items("- a\n    b\n") == "- a\n    b\n"  # already 4 columns: unchanged
    fenced = "```text\n- not an item\n  x\n```\n"
    assert docs_hooks.widen_list_items(fenced) == fenced


def test_indented_snippets_are_dedented_and_nothing_else_moves():
    page = "text\n\n```python\n    a = 1\n        b = 2\n```\n\n  ```bash\n    run x\n  ```\n\n```\n```\n"
    out = docs_hooks.dedent_fences(page)
    assert out == "text\n\n```python\na = 1\n    b = 2\n```\n\n  ```bash\n  run x\n  ```\n\n```\n```\n"


def test_inline_code_breaks_only_at_its_spaces():
    html = '<p><code>pip install -e ".[trl]"</code></p><pre><code>a b</code></pre><td><code>x</code></td>'
    assert docs_hooks.unbreakable_tokens(html) == (
        '<p><code><span class="nobreak">pip</span> <span class="nobreak">install</span> <span class="nobreak">-e'
        '</span> <span class="nobreak">".[trl]"</span></code></p><pre><code>a b</code></pre>'
        '<td><code><span class="nobreak">x</span></code></td>')
