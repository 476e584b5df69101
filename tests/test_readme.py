"""The README's checkable claims stay true: every recipe, objective, extra, file and eval flag it names exists, and
everything that exists and a user picks by name (tiny recipes, objectives, extras, production recipes) is named."""

from __future__ import annotations

import ast
import itertools
import re

from helpers import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    start = README.index(title)
    end = README.find("\n#", start + len(title))
    return README[start:end if end != -1 else None]


def _expand(pattern: str):
    """`a_{x,y}_b` -> a_x_b, a_y_b (the README's brace shorthand for recipe families)."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def test_every_tiny_recipe_is_in_the_table():
    table = _section("| recipe (`recipes/tiny/`)")
    named = set(re.findall(r"`([a-z0-9_]+)\.yaml`", table))
    shipped = {p.stem for p in (REPO / "recipes" / "tiny").glob("*.yaml") if not p.name.startswith("_")}
    assert shipped - named == set(), "tiny recipes missing from the README's table"
    assert named - shipped == set(), "the README's table names tiny recipes that do not exist"


def test_every_production_recipe_is_in_the_table():
    table = _section("### Production recipes")
    named = {name for cell in re.findall(r"^\| `([^`]+\.yaml)`", table, re.M) for name in _expand(cell)}
    shipped = {p.name for p in (REPO / "recipes").glob("*.yaml")}
    assert shipped - named == set(), "production recipes missing from the README's table"
    assert named - shipped == set(), "the README's table names recipes that do not exist"


def test_every_objective_is_named():
    from hl_core.objectives import OBJECTIVES

    paragraph = README[README.index("Objectives (`objective.name`)"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    assert {name for name in OBJECTIVES if f"`{name}`" not in paragraph} == set()


def _extras():
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return {key.value for key in node.value.keys}
    raise AssertionError("setup.py has no extras_require")


def test_every_extra_is_in_the_table():
    extras = _extras()
    table = _section("| extra | for |")
    named = set(re.findall(r"^\| `([a-z]+)` \|", table, re.M))
    assert named == extras


def test_every_named_file_exists():
    paths = set(re.findall(r"\b((?:bench|tests|docs|recipes|eval|hl_core|launchers)/[A-Za-z0-9_./-]+"
                           r"\.(?:py|md|json|png|yaml))\b", README))
    assert len(paths) > 20  # the pattern finds the README's paths
    missing = sorted(p for p in paths if "{" not in p and not (REPO / p).exists())
    assert missing == [], "the README names files that do not exist"


def test_the_eval_flags_it_names_exist():
    from eval.__main__ import build_parser

    flags = {opt for action in build_parser()._actions for opt in action.option_strings}
    section = _section("### Evaluation")
    named = set(re.findall(r"(--[a-z][a-z0-9-]+)", section))
    assert named and named - flags == set()
