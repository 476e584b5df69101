"""The README's and the docs site's checkable claims stay true: every relative link (and README anchor), every file
path, command, recipe key and flag they name exists; the README keeps its order, length and first screen; its YAML
recipe is what the loader resolves; and everything a user picks by name (tiny and production recipes, objectives,
extras) is named in the docs."""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import itertools
import re
import shlex
from functools import lru_cache
from pathlib import Path

import yaml

from helpers import REPO, TINY_HUMANLINE, run_recipe

README = (REPO / "README.md").read_text(encoding="utf-8")
DOCS = sorted((REPO / "docs").rglob("*.md"))
# the study and measurement records are dated logs of what ran then (their commands name the flags of that commit);
# the generated key reference is checked against the schema by tests/test_config.py
RECORDS = ("docs/perf/", "docs/repro/", "docs/recipe-keys.md")
PAGES = [REPO / "README.md"] + [p for p in DOCS if not str(p.relative_to(REPO)).startswith(RECORDS)]


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _page(name: str) -> str:
    return _text(REPO / "docs" / name)


def _section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n#", start + len(title))
    return text[start:end if end != -1 else None]


def _expand(pattern: str):
    """`a_{x,y}_b` -> a_x_b, a_y_b (the brace shorthand for recipe families)."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _code_spans(text: str):
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


def _code_blocks(text: str, lang: str):
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


# ------------------------------------------------------------------------------------------- the README itself


def test_readme_is_a_front_door():
    """For someone who has never heard of humanline: what and who first, the three ways in with links, install and
    the demo; the method's formulas and the switches live on the concepts page, not here."""
    lines = README.splitlines()
    assert 120 <= len(lines) <= 200, len(lines)
    order = ["## Three ways in", "## Install and run the demo", "## One recipe, resolved", "## Running at scale",
             "## Documentation"]
    assert [h for h in lines if h.startswith("## ")] == order
    intro = README[:README.index("## Three ways in")]
    for spelled in ("DPO (Direct Preference Optimization)", "KTO (Kahneman-Tversky Optimization)",
                    "GRPO (Group Relative Policy Optimization)"):
        assert spelled in " ".join(intro.split()), spelled
    ways = _section(README, "## Three ways in")
    for link in ("docs/quickstart.md#1-a-recipe-and-the-launcher-command-line", "docs/quickstart.md#2-trls-trainers",
                 "docs/quickstart.md#3-your-own-loop-python-api", "docs/howto/own-loop.md"):
        assert f"]({link})" in ways, link
    assert "`hl_core.integrations.trl`" in ways and "examples/" in ways  # the TRL adapter and the examples
    first_screen = "\n".join(lines[:60])
    assert ("pip install torch==2.13.0 && pip install -e . && deepspeed launchers/run.py "
            "recipes/tiny/humanline_dpo.yaml") in first_screen
    front = README[:README.index("## One recipe, resolved")]  # (the resolved recipe below shows every key)
    for insider in ("theta_ref <- theta_n", "clamp(", "log_eps_P", "ZeRO 0-3", "token-rejection"):
        assert insider not in front, insider
    assert "| switch | effect |" not in README
    assert "```bash\nbash .ci/run\n```" in README
    assert 'pip install -e ".[docs]" && mkdocs serve' in README
    demo_output = _code_blocks(_section(README, "## Install and run the demo"), "text")
    assert len(demo_output) == 1 and len(demo_output[0].strip().splitlines()) == 9


_NUMBER = re.compile(r"-?\d+\.\d+")


def _summary(text: str) -> list:
    """The demo's closing summary, from its `== name: N updates` line on, decimals and the output directory masked
    (times and the last digits of accuracies move with the machine; the words, lines and counts must not)."""
    lines = text[text.index("== humanline_dpo:"):].strip().splitlines()
    lines = [re.sub(r"^plot: python -m eval.report (\S+) -o \1/report$", "plot: OUT", line) for line in lines]
    return [_NUMBER.sub("#", re.sub(r"^outputs: \S+/metrics\.jsonl", "outputs: OUT/metrics.jsonl", line))
            for line in lines]


def test_the_readme_demo_summary_is_what_the_demo_prints(tmp_path):
    """The README's summary block, line for line, against a real run of the demo's recipe (one process)."""
    (shown,) = _code_blocks(_section(README, "## Install and run the demo"), "text")
    proc = run_recipe(TINY_HUMANLINE, [f"output_dir={tmp_path / 'runs' / 'tiny_humanline_dpo'}"])
    printed = _summary(proc.stdout)
    assert _summary(shown) == printed[:len(_summary(shown))] and len(printed) == len(_summary(shown)), printed
    assert "runs/tiny_humanline_dpo/metrics.jsonl" in shown  # the recipe's own output_dir, as a user sees it
    (also_shown,) = [b for b in _code_blocks(_page("getting-started.md"), "text") if "== humanline_dpo:" in b]
    assert also_shown == shown  # the getting-started page shows the same summary


def test_the_summary_comparison_can_fail():
    shown = "== humanline_dpo: 40 updates in 1.0s ==\nheld-out: 0.5 -> 1.0\noutputs: runs/x/metrics.jsonl, final/\n"
    assert _summary(shown) == _summary(shown.replace("1.0s", "9.9s").replace("runs/x", "/tmp/y"))
    assert _summary(shown) != _summary(shown.replace("40 updates", "41 updates"))
    assert _summary(shown) != _summary(shown.replace("held-out", "held out"))


def test_the_quickstart_python_api_snippet_runs():
    """The quickstart's own-loop snippet, as printed on the page, runs and trains three updates."""
    import subprocess
    import sys

    blocks = _code_blocks(_page("quickstart.md"), "python")
    (snippet,) = [b for b in blocks if "ReferenceSync" in b]
    proc = subprocess.run([sys.executable, "-c", snippet], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.split()[0] for line in proc.stdout.splitlines()] == ["0", "1", "2"]


def _leaves(value, prefix=""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix, value


def test_the_readme_recipe_is_what_the_demo_resolves_to():
    from hl_core.config import load_recipe

    (block,) = _code_blocks(README, "yaml")
    shown = dict(_leaves(yaml.safe_load(block)))
    resolved = dict(_leaves(load_recipe(TINY_HUMANLINE).model_dump()))
    assert len(shown) > 30
    assert {k: v for k, v in shown.items() if k not in resolved} == {}, "keys the resolved recipe does not have"
    assert {k: (v, resolved[k]) for k, v in shown.items() if resolved[k] != v} == {}


def test_the_method_pages_switches_are_recipe_keys():
    table = _section(_page("concepts/method.md"), "## The switches")
    switches = [cell.split("=")[0] for cell in re.findall(r"^\| `([a-z_.]+=?[^`]*)`", table, re.M)]
    assert len(switches) >= 10 and all(_is_key_or_group(s) for s in switches), switches


# ------------------------------------------------------------------------------------------- links


def _slug(heading: str) -> str:
    """GitHub's and mkdocs' anchor for a heading (lower case, punctuation dropped, spaces to hyphens)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path):
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", _text(path), re.M)}


def broken_links(page: Path) -> list:
    """The relative links of ``page`` (outside code blocks) whose file or heading anchor does not exist."""
    text = re.sub(r"```.*?```", "", _text(page), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    return broken


def _every_page(check, pages) -> dict:
    """``{page: what check found}`` for every page where ``check`` found something: one test lists them all."""
    return {str(page.relative_to(REPO)): found for page in pages if (found := check(page))}


def test_every_relative_link_exists():
    assert _every_page(broken_links, PAGES + [p for p in DOCS if p not in PAGES]) == {}


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n[a](missing.md) [b](#no-such-heading) [c](#title)\n")
    assert broken_links(page) == ["missing.md", "#no-such-heading"]


# ------------------------------------------------------------------------------------------- paths

_PATH = re.compile(r"(?<![\w/.$-])((?:\.ci|bench|docker|docs|eval|hl_core|launchers|recipes|requirements|tests|tools)"
                   r"/[A-Za-z0-9_./*{}<>-]*|Dockerfile|mkdocs\.yml|setup\.py)")


def missing_paths(page: Path) -> list:
    """The repository paths ``page`` names (in code and prose) that do not exist."""
    named = set()
    for span in _code_spans(_text(page)) + _code_blocks(_text(page), "bash"):
        named |= {m.rstrip(".,:") for m in _PATH.findall(span)}
    named |= {m.rstrip(".,:") for m in _PATH.findall(re.sub(r"```.*?```", "", _text(page), flags=re.S))}
    named = {n for n in named if not re.search(r"[*{}<>]|/X\.|RECIPE|\.\.\.", n)}
    # `hl_core/humanline`: a module or a package of that name
    return sorted(n for n in named if not (REPO / n).exists() and not (REPO / f"{n}.py").exists())


def test_every_named_path_exists():
    # authors-settings.md cites the authors' own files
    assert _every_page(missing_paths, [p for p in PAGES if p.name != "authors-settings.md"]) == {}


def test_the_path_pattern_finds_paths(tmp_path):
    assert len(set(_PATH.findall(README))) > 10
    page = tmp_path / "p.md"
    page.write_text("See `hl_core/objectives/dpo.py` and `hl_core/no_such_module.py`.\n")
    assert missing_paths(page) == ["hl_core/no_such_module.py"]
    assert _PATH.findall("see `hl_core/objectives/dpo.py` and /workspace/humanline/x") == ["hl_core/objectives/dpo.py"]


# ------------------------------------------------------------------------------------------- recipe keys


@lru_cache(maxsize=1)
def _keys():
    from hl_core.config.keys_doc import recipe_keys_markdown

    return frozenset(re.findall(r"^\| `([^`]+)` \|", recipe_keys_markdown(), re.M))


@lru_cache(maxsize=1)
def _groups():
    from hl_core.config.schema import Recipe

    return frozenset(Recipe.model_fields)


def _is_key_or_group(name: str) -> bool:
    keys = _keys()
    if "*" in name:
        return any(fnmatch.fnmatch(k, name) for k in keys)
    return name in keys or any(k.startswith(name + ".") or k.startswith(name + "[") for k in keys)


def _named_keys(text: str):
    """Dotted words in code that start with a recipe group: `train.lr`, `humanline.sync_every=1`, `eval.every: 10`."""
    out = set()
    for span in _code_spans(text):
        for word in span.split():
            word = re.split(r"[=:,]", word, maxsplit=1)[0].strip("()")
            head = word.split(".")[0]
            if "." in word and head in _groups() and re.fullmatch(r"[a-z_][a-z0-9_.\[\]*]*", word):
                out.add(word)
    return out


def unknown_keys(page: Path) -> list:
    """The dotted recipe keys ``page`` names in code that the schema does not have (files and modules aside)."""
    files = (".py", ".json", ".jsonl", ".yaml", ".md", ".safetensors", ".png", ".pt", ".txt")
    named = _named_keys(_text(page))
    return sorted(k for k in named if not k.endswith(files) and not _is_key_or_group(k) and not _importable(k))


def test_every_named_recipe_key_exists():
    assert _every_page(unknown_keys, PAGES) == {}


def test_the_key_check_can_fail(tmp_path):
    named = _named_keys("set `humanline.sync_evry=2` or `train.lr=1e-4` and `model.lora.r`")
    assert named == {"humanline.sync_evry", "train.lr", "model.lora.r"}
    assert [k for k in sorted(named) if not _is_key_or_group(k)] == ["humanline.sync_evry"]
    page = tmp_path / "p.md"
    page.write_text("set `humanline.sync_evry=2` or `train.lr=1e-4`\n")
    assert unknown_keys(page) == ["humanline.sync_evry"]


def _importable(name: str) -> bool:
    """A module (`eval.report`) or a module's attribute (`eval.repro.fair.select`) of that dotted name."""
    try:
        if importlib.util.find_spec(name) is not None:
            return True
    except (ImportError, AttributeError, ValueError):
        pass
    parent, _, attr = name.rpartition(".")
    try:
        return bool(parent) and hasattr(importlib.import_module(parent), attr)
    except ImportError:
        return False


# ------------------------------------------------------------------------------------------- commands and flags


@lru_cache(maxsize=None)
def _parser_flags(module: str):
    mod = importlib.import_module(module)
    return frozenset(opt for action in mod.build_parser()._actions for opt in action.option_strings)


@lru_cache(maxsize=None)
def _source_text(target: str) -> str:
    """The source of a script (`bench/x.py`, with the sibling modules it imports: `examples/_launch.py`) or a module
    (`eval.repro`: its package's files)."""
    if target.endswith(".py"):
        text = _text(REPO / target)
        siblings = (REPO / target).parent
        return "\n".join([text,
                          *(_text(siblings / f"{name}.py") for name in re.findall(r"^from (\w+) import", text, re.M)
                                   if (siblings / f"{name}.py").is_file())])
    spec = importlib.util.find_spec(target)
    assert spec is not None and spec.origin, f"no module {target}"
    origin = Path(spec.origin)
    files = origin.parent.rglob("*.py") if origin.name == "__init__.py" or origin.name == "__main__.py" else [origin]
    return "\n".join(_text(f) for f in files)


PARSED = {"launchers/run.py": "launchers.run", "launchers/slurm.py": "launchers.slurm", "eval": "eval.__main__"}


def _commands(text: str):
    """Command lines in bash blocks and in code spans that start with python, deepspeed, torchrun or bash."""
    lines = []
    for block in _code_blocks(text, "bash"):
        lines += block.replace("\\\n", " ").splitlines()
    lines += [s for s in _code_spans(text) if re.match(r"(python3?|deepspeed|torchrun|bash) ", s)]
    return [line.split("#", 1)[0] if " #" in line or line.startswith("#") else line for line in lines]


def _check_command(line: str):
    """Problems with one command line: a script or module that does not exist, a flag it does not take."""
    try:
        words = shlex.split(line)
    except ValueError:
        return []
    words = [w for w in words if w not in ("[", "]", "...")]
    problems = []
    for i, word in enumerate(words):
        target = None
        if word.endswith(".py") and not word.startswith("/") and words[i - 1:i] != ["-m"]:
            target = word
            if not (REPO / word).exists():
                problems.append(f"no file {word}")
                continue
        elif word == "-m" and i + 1 < len(words) and words[i - 1] in ("python", "python3"):
            target = words[i + 1]
            if re.search(r"[A-Z]{3,}", target):  # a placeholder: `python -m eval.MODULE`
                break
            if importlib.util.find_spec(target) is None:
                problems.append(f"no module {target}")
                continue
        elif word == "bash" and i + 1 < len(words) and words[i + 1][0] != "-" and not (REPO / words[i + 1]).exists():
            problems.append(f"no script {words[i + 1]}")
        if target is None or target in ("torch.distributed.run", "pytest", "pip", "mkdocs", "ruff"):
            continue
        flags = [re.split(r"[=\[]", w)[0] for w in words[i + 1:] if re.match(r"--[a-z]", w) and w != "--help"]
        if target in PARSED:
            known = _parser_flags(PARSED[target])
            problems += [f"{target} has no {f}" for f in flags if f not in known]
        else:
            source = _source_text(target)
            problems += [f"{target} has no {f}" for f in flags if f'"{f}"' not in source and f"'{f}'" not in source]
        break
    return problems


def bad_commands(page: Path) -> dict:
    """``{command line: problems}`` for the commands ``page`` shows that name a missing file, module or flag."""
    return {line: p for line in _commands(_text(page)) if (p := _check_command(line))}


def test_every_command_and_flag_exists():
    assert _every_page(bad_commands, PAGES) == {}


def test_the_command_check_can_fail(tmp_path):
    assert _check_command("python launchers/run.py recipes/tiny/humanline_dpo.yaml --validate") == []
    assert _check_command("python launchers/run.py R.yaml --valdate") == ["launchers/run.py has no --valdate"]
    assert _check_command("python launchers/slurm.py R.yaml --container x --use-checkout --mount /d") == []
    assert _check_command("python -m eval.repro --study preference --quik") == ["eval.repro has no --quik"]
    assert _check_command("python -m eval.nothing_here") == ["no module eval.nothing_here"]
    assert _check_command("python bench/no_such.py") == ["no file bench/no_such.py"]
    assert len(_commands(README)) >= 8
    page = tmp_path / "p.md"
    page.write_text("```bash\npython launchers/run.py R.yaml --valdate\n```\n")
    assert bad_commands(page) == {"python launchers/run.py R.yaml --valdate": ["launchers/run.py has no --valdate"]}


# ------------------------------------------------------------------------------------------- named sets


def test_every_tiny_recipe_is_in_the_table():
    table = _section(_page("howto/recipes.md"), "| recipe (`recipes/tiny/`)")
    named = set(re.findall(r"`([a-z0-9_]+)\.yaml`", table))
    shipped = {p.stem for p in (REPO / "recipes" / "tiny").glob("*.yaml") if not p.name.startswith("_")}
    assert shipped - named == set(), "tiny recipes missing from the recipes page's table"
    assert named - shipped == set(), "the recipes page's table names tiny recipes that do not exist"


def test_every_production_recipe_is_in_the_table():
    table = _section(_page("howto/recipes.md"), "## Production recipes")
    named = {name for cell in re.findall(r"^\| `([^`]+\.yaml)`", table, re.M) for name in _expand(cell)}
    shipped = {p.name for p in (REPO / "recipes").glob("*.yaml")}
    assert shipped - named == set(), "production recipes missing from the recipes page's table"
    assert named - shipped == set(), "the recipes page's table names recipes that do not exist"


def test_every_objective_is_named():
    from hl_core.objectives import OBJECTIVES

    page = _page("howto/recipes.md")
    paragraph = page[page.index("Objectives (`objective.name`)"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    assert {name for name in OBJECTIVES if f"`{name}`" not in paragraph} == set()


def _extras():
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return {key.value for key in node.value.keys}
    raise AssertionError("setup.py has no extras_require")


def test_every_extra_is_in_the_table_and_the_readme():
    extras = _extras()
    table = _section(_page("getting-started.md"), "| extra | for |")
    assert set(re.findall(r"^\| `([a-z]+)` \|", table, re.M)) == extras
    listed = README[README.index("Extras:"):]
    assert set(re.findall(r"`([a-z]+)`", listed[:listed.index("(")])) == extras


def test_the_eval_flags_it_names_exist():
    """Every `--flag` of the evaluation page is a `python -m eval` flag, but on the command lines of another program
    it shows (lm-eval's own CLI in a second environment, venv, pip: with their backslash continuations)."""
    kept, other = [], False
    for line in _page("howto/evaluation.md").splitlines():
        other = other or re.match(r"\s*(\S*/)?(lm_eval|pip|python3? -m (venv|pip))\b", line) is not None
        if not other:
            kept.append(line)
        other = other and line.rstrip().endswith("\\")
    named = set(re.findall(r"(--[a-z][a-z0-9-]+)", "\n".join(kept)))
    assert named and named - _parser_flags("eval.__main__") == set()


def test_every_page_is_in_the_site_nav():
    nav = _text(REPO / "mkdocs.yml")
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, re.M))
    assert {str(p.relative_to(REPO / "docs")) for p in DOCS} == listed


def test_the_generated_cli_reference_covers_every_parser_flag():
    from tools import docs_hooks
    page = docs_hooks.on_page_markdown(_page("reference/cli.md"))
    assert "<!-- argparse:" not in page
    import argparse
    import importlib

    for module in ("launchers.run", "launchers.slurm", "eval.__main__"):
        shown = {opt for action in importlib.import_module(module).build_parser()._actions
                 if action.help != argparse.SUPPRESS for opt in action.option_strings}
        assert len(shown) > 5 and shown - set(re.findall(r"--?[a-z][a-z0-9-]*", page)) == set(), module
