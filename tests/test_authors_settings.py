"""docs/authors-settings.md cannot go stale: every row with a recipe key names recipes that exist, and each of
them resolves the key to the row's "Ours" value; every production recipe is covered; every row cites a source."""

import fnmatch
import re

import pytest
import yaml

from helpers import REPO
from hl_core.config import load_recipe

DOC = REPO / "docs" / "authors-settings.md"
PRODUCTION = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
COLUMNS = ["Setting", "Recipes", "Key", "Authors", "Source", "Ours", "Why we differ"]
CODE = re.compile(r"`([^`]*)`")


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def settings_rows(text):
    """Rows of every table whose header is COLUMNS, as dicts."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if cells == COLUMNS:
            header = cells
        elif header and not set(line) <= set("|-: "):
            assert len(cells) == len(header), f"row has {len(cells)} cells, expected {len(header)}: {line}"
            rows.append(dict(zip(header, cells)))
    return rows


def _value(recipe, key):
    value = recipe
    for part in key.split("."):
        value = getattr(value, part)
    return list(value) if isinstance(value, tuple) else value


ROWS = settings_rows(DOC.read_text(encoding="utf-8"))


def test_the_tables_are_found_and_every_row_cites_a_source():
    assert len(ROWS) >= 60
    for row in ROWS:
        assert re.search(r"(HALOs|open-r1 fork|TRL 0\.18\.0) `[^`]+:\d", row["Source"]), row
        assert row["Why we differ"], row


def test_every_production_recipe_is_covered():
    named = {stem for row in ROWS for pattern in CODE.findall(row["Recipes"]) for stem in PRODUCTION
             if fnmatch.fnmatch(stem, pattern)}
    uncovered = [s for s in PRODUCTION if s not in named and not s.startswith("gemma2_27b")]
    assert not uncovered


_CHECKS = [(row["Setting"], CODE.findall(row["Key"])[0], pattern, row["Ours"])
           for row in ROWS if CODE.findall(row["Key"]) for pattern in CODE.findall(row["Recipes"])]


@pytest.mark.parametrize("setting, key, pattern, ours", _CHECKS, ids=[f"{c[1]}@{c[2]}" for c in _CHECKS])
def test_recipes_hold_the_ours_value(setting, key, pattern, ours):
    stems = [s for s in PRODUCTION if fnmatch.fnmatch(s, pattern)]
    assert stems, f"{pattern} names no production recipe"
    (literal,) = CODE.findall(ours) or [None]
    assert literal is not None, f"{setting}: the Ours cell must hold the value in backticks"
    expected = yaml.safe_load(literal)
    for stem in stems:
        got = _value(load_recipe(REPO / "recipes" / f"{stem}.yaml"), key)
        assert got == expected, f"{stem}: `{key}` is {got!r}, docs/authors-settings.md says {expected!r} ({setting})"
