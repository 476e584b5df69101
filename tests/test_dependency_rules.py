"""The project's structure, checked over its own source by parsing imports (``ast``): ``import x`` and
``from x import y``, relative imports resolved to absolute names, imports inside functions included.

* ``hl_core``'s packages are layered as the table in ``docs/architecture.md`` says (read from the document, so the
  two cannot drift): a package imports only packages of a lower layer, and the table names exactly the
  packages and modules at the root of ``hl_core``;
* ``hl_core`` never reaches ``eval`` or ``launchers``; ``hl_core.config`` reaches no engine library;
* no import circle between modules of ``hl_core``, ``eval`` and ``launchers``;
* no Python file over 500 lines, the trainer under 400 (TRL's test files vendored unmodified in
  ``tests/trl_upstream/vendored`` are not ours: ``tools/trl_vendor.py`` keeps them byte-identical to TRL's);
* an import inside a function in ``hl_core`` says why (a comment on its line or the line above, or one
  ``# Imports inside functions: ...`` note in the module);
* only ``hl_core/config/`` and the trainer receive the whole recipe (``docs/architecture.md``, "Who reads the whole
  recipe"): no other function of ``hl_core`` has a parameter named ``recipe`` or annotated ``Recipe``, and no other
  object keeps one as its ``recipe`` attribute. Every other component receives its section(s), an answer of
  ``hl_core.config.decisions`` or a view of ``hl_core.config.views``.
"""

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

from helpers import REPO

PACKAGES = ("hl_core", "eval", "launchers")
# (package whose modules are checked, forbidden modules: each with everything under it), followed transitively
RULES = [
    ("hl_core", ("eval", "launchers")),
    ("hl_core.config", ("deepspeed", "megatron")),
]
LAYER_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([\w.]+)`\s*\|")
MAX_LINES, MAX_TRAINER_LINES = 500, 400
THIRD_PARTY = (Path("tests") / "trl_upstream" / "vendored",)  # other projects' files, kept byte-identical
FILE_NOTE = "# Imports inside functions:"
RECIPE_READERS = ("hl_core/config/", "hl_core/trainer.py")  # where the whole recipe may be received


def layers(root: Path) -> Dict[str, int]:
    """``{root entry of hl_core: layer}`` from the table in ``docs/architecture.md``."""
    rows = [LAYER_ROW.match(line) for line in (root / "docs" / "architecture.md").read_text().splitlines()]
    return {m.group(2): int(m.group(1)) for m in rows if m}


def source_modules(root: Path) -> Dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the repository's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imports_of(path: Path, module: str) -> List[Tuple[str, ast.stmt]]:
    """``(absolute name, node)`` for everything ``path`` (the module ``module``) imports, anywhere in the file.
    For ``from m import x`` both ``m`` and ``m.x`` are listed (``x`` may be a submodule)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            found.append((source, node))
            found += [(f"{source}.{alias.name}", node) for alias in node.names if alias.name != "*"]
    return found


def imported_names(path: Path, module: str) -> Set[str]:
    return {name for name, _ in imports_of(path, module)}


def _with_parents(name: str) -> List[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def reachable(start: str, modules: Dict[str, Path]) -> Dict[str, List[str]]:
    """Every name imported by ``start`` or, transitively, by the repository modules it imports (and their
    parent packages, which an import runs first) -> the chain of modules that leads to it."""
    chains = {start: [start]}
    queue, seen = [start], {start}
    while queue:
        current = queue.pop(0)
        for name in sorted(imported_names(modules[current], current)):
            for step in _with_parents(name):
                chains.setdefault(step, chains[current] + [step])
                if step in modules and step not in seen:
                    seen.add(step)
                    queue.append(step)
    return chains


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _unit(name: str) -> str:
    """The root entry of ``hl_core`` a module belongs to (``hl_core.loop.guard`` -> ``loop``)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(root: Path) -> List[str]:
    """``module: imports target (layer a -> layer b)`` for every import that does not go to a lower layer."""
    table, modules, found = layers(root), source_modules(root), []
    for module in sorted(m for m in modules if _under(m, "hl_core") and m != "hl_core"):
        own = _unit(module)
        for name, _ in imports_of(modules[module], module):
            other = _unit(name) if _under(name, "hl_core") else ""
            if not other or other == own or other not in table or own not in table:
                continue
            if table[other] >= table[own]:
                found.append(f"{module}: imports {name} (layer {table[own]} `{own}` -> layer {table[other]} `{other}`)")
    return sorted(set(found))


def table_mismatch(root: Path) -> Tuple[Set[str], Set[str]]:
    """(root entries of hl_core the table leaves out, table rows with no such entry)."""
    entries = {p.stem for p in (root / "hl_core").glob("*.py") if p.name != "__init__.py"}
    entries |= {p.name for p in (root / "hl_core").iterdir() if (p / "__init__.py").is_file()}
    table = set(layers(root))
    return entries - table, table - entries


def rule_violations(root: Path) -> List[str]:
    """``module: imports forbidden (via a -> b -> c)`` for every rule broken under ``root`` (the shortest chain)."""
    modules = source_modules(root)
    found = []
    for package, forbidden in RULES:
        for module in sorted(m for m in modules if _under(m, package)):
            chains = reachable(module, modules)
            for prefix in forbidden:
                hits = [chain for name, chain in sorted(chains.items()) if _under(name, prefix)]
                if hits:
                    found.append(f"{module}: imports {prefix} (via {' -> '.join(min(hits, key=len))})")
    return found


def import_circles(root: Path) -> List[List[str]]:
    """Strongly connected groups of two or more modules, by direct imports (a package's ``from . import sub``
    names the package itself: that is not an edge)."""
    modules = source_modules(root)
    graph = {m: sorted({n for n in imported_names(p, m) if n in modules and n != m}) for m, p in modules.items()}
    index, low, stack, on_stack, groups, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def unexplained_function_imports(root: Path) -> List[str]:
    """``file:line`` of each import inside a function of ``hl_core`` that gives no reason."""
    found = []
    for path in sorted((root / "hl_core").rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        if any(line.startswith(FILE_NOTE) for line in lines):
            continue
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    own = " ".join(lines[node.lineno - 1: node.end_lineno])
                    above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                    if "#" not in own and not above.startswith("#"):
                        found.append(f"{path.relative_to(root)}:{node.lineno}")
    return sorted(set(found))


def _names_recipe(annotation) -> bool:
    """Whether an annotation names the ``Recipe`` class (``Recipe``, ``config.Recipe``, ``"Recipe"``, inside
    ``Optional[...]`` or ``Callable[[Recipe], ...]`` too)."""
    for node in ast.walk(annotation) if annotation is not None else ():
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""
        if name == "Recipe" or re.search(r"\bRecipe\b", text):
            return True
    return False


def recipe_receivers(root: Path) -> List[str]:
    """``file:line name`` of every function of ``hl_core`` outside ``RECIPE_READERS`` with a parameter named
    ``recipe`` or annotated ``Recipe``, and of every assignment to a ``recipe`` attribute there."""
    found = []
    for path in sorted((root / "hl_core").rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if where.startswith(RECIPE_READERS):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                params = a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p is not None]
                found += [f"{where}:{node.lineno} {getattr(node, 'name', 'lambda')}({p.arg})" for p in params
                          if p.arg == "recipe" or _names_recipe(p.annotation)]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [f"{where}:{node.lineno} .recipe" for t in targets for n in ast.walk(t)
                          if isinstance(n, ast.Attribute) and n.attr == "recipe" and isinstance(n.ctx, ast.Store)]
    return found


def long_files(root: Path) -> List[str]:
    found = []
    for folder in (*PACKAGES, "bench", "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            if any(root / part in path.parents for part in THIRD_PARTY):
                continue
            limit = MAX_TRAINER_LINES if path == root / "hl_core" / "trainer.py" else MAX_LINES
            count = len(path.read_text().splitlines())
            if count >= limit + (0 if limit == MAX_TRAINER_LINES else 1):
                found.append(f"{path.relative_to(root)}: {count} lines (limit {limit})")
    return found


# -------------------------------------------------------------------------------------------- the tree as it is
def test_the_layering_of_docs_architecture_holds():
    assert not layer_violations(REPO), "\n".join(layer_violations(REPO))


def test_the_architecture_table_names_exactly_the_root_of_hl_core():
    missing, stale = table_mismatch(REPO)
    assert not missing, f"add to the table in docs/architecture.md: {sorted(missing)}"
    assert not stale, f"docs/architecture.md names what hl_core no longer has: {sorted(stale)}"


def test_hl_core_reaches_no_launcher_or_eval_and_config_no_engine_library():
    assert not rule_violations(REPO), "\n".join(rule_violations(REPO))


def test_no_import_circle():
    assert not import_circles(REPO), import_circles(REPO)


def test_no_file_over_the_line_limits():
    assert not long_files(REPO), "\n".join(long_files(REPO))


def test_imports_inside_functions_say_why():
    assert not unexplained_function_imports(REPO), "\n".join(unexplained_function_imports(REPO))


def test_only_config_and_the_trainer_receive_the_whole_recipe():
    found = recipe_receivers(REPO)
    assert not found, ("these receive the whole recipe; hand them their sections, or a view built in hl_core/config "
                       "(decisions.py, views.py) instead:\n" + "\n".join(found))


def test_the_rules_cover_every_package_they_name():
    modules = source_modules(REPO)
    for package, _ in RULES:
        assert package in modules, package  # a renamed package must not silently switch a rule off
    assert len(layers(REPO)) >= 10  # the table parsed


# -------------------------------------------------------------------------------------------- the checkers can fail
ARCH = """| layer | package | owns |
|---|---|---|
| 0 | `errors` | x |
| 2 | `objectives` | x |
| 3 | `config` | x |
| 5 | `engines` | x |
| 7 | `rollout` | x |
| 8 | `trainer` | x |
| 8 | `preflight` | x |
"""


def _plant(root: Path, files: Dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _clean_tree(root: Path) -> None:
    clean = {f"{p}/__init__.py": "" for p in PACKAGES + ("hl_core/objectives", "hl_core/config", "hl_core/rollout",
                                                       "hl_core/engines", "hl_core/preflight")}
    clean.update({"hl_core/engines/base.py": "", "hl_core/errors.py": "", "hl_core/trainer.py": "",
                  "hl_core/preflight/plan.py": "", "eval/run_from_recipe.py": "", "launchers/run.py": "",
                  "docs/architecture.md": ARCH})
    _plant(root, clean)


@pytest.mark.parametrize("files, expected", [
    ({"hl_core/objectives/dpo.py": "from ..engines import base\n"},
     "hl_core.objectives.dpo: imports hl_core.engines (layer 2 `objectives` -> layer 5 `engines`)"),
    ({"hl_core/config/load.py": "def f():\n    from ..rollout import x  # lazy\n"},
     "hl_core.config.load: imports hl_core.rollout (layer 3 `config` -> layer 7 `rollout`)"),
    ({"hl_core/preflight/plan.py": "from ..trainer import run\n"},  # same layer is not allowed either
     "hl_core.preflight.plan: imports hl_core.trainer (layer 8 `preflight` -> layer 8 `trainer`)"),
])
def test_the_layer_checker_catches_a_planted_import(tmp_path, files, expected):
    _clean_tree(tmp_path)
    assert layer_violations(tmp_path) == []
    _plant(tmp_path, files)
    assert any(v.startswith(expected) for v in layer_violations(tmp_path)), layer_violations(tmp_path)


@pytest.mark.parametrize("files, expected", [
    ({"hl_core/trainer.py": "def post():\n    from eval.run_from_recipe import run_post_training_eval\n"},
     "hl_core.trainer: imports eval"),
    ({"hl_core/preflight/plan.py": "import launchers.run as run\n"}, "hl_core.preflight.plan: imports launchers"),
    ({"hl_core/config/checks.py": "def check():\n    import deepspeed\n"}, "hl_core.config.checks: imports deepspeed"),
    # through another module of the repository: config -> engines -> megatron
    ({"hl_core/config/load.py": "from ..engines import base\n", "hl_core/engines/base.py": "import megatron.core\n"},
     "hl_core.config.load: imports megatron (via hl_core.config.load -> hl_core.engines.base -> megatron)"),
])
def test_the_rule_checker_catches_a_planted_import(tmp_path, files, expected):
    _clean_tree(tmp_path)
    assert rule_violations(tmp_path) == []
    _plant(tmp_path, files)
    assert any(v.startswith(expected) for v in rule_violations(tmp_path)), rule_violations(tmp_path)


def test_the_other_checkers_catch_planted_problems(tmp_path):
    _clean_tree(tmp_path)
    assert import_circles(tmp_path) == [] and long_files(tmp_path) == [] and table_mismatch(tmp_path) == (set(), set())
    assert unexplained_function_imports(tmp_path) == []
    _plant(tmp_path, {"hl_core/engines/base.py": "from ..rollout import gen\n",
                      "hl_core/rollout/gen.py": "from ..engines import base\n"})
    assert import_circles(tmp_path) == [["hl_core.engines.base", "hl_core.rollout.gen"]]
    _plant(tmp_path, {"hl_core/trainer.py": "x = 1\n" * MAX_TRAINER_LINES, "tests/t.py": "x = 1\n" * (MAX_LINES + 1)})
    assert long_files(tmp_path) == [f"hl_core/trainer.py: {MAX_TRAINER_LINES} lines (limit {MAX_TRAINER_LINES})",
                                    f"tests/t.py: {MAX_LINES + 1} lines (limit {MAX_LINES})"]
    _plant(tmp_path, {"hl_core/newthing.py": "def f():\n    import json\n    # why\n    import os\n"})
    assert table_mismatch(tmp_path) == ({"newthing"}, set())
    assert unexplained_function_imports(tmp_path) == ["hl_core/newthing.py:2"]
    _plant(tmp_path, {"hl_core/newthing.py": f"{FILE_NOTE} optional\ndef f():\n    import json\n"})
    assert unexplained_function_imports(tmp_path) == []


def test_the_recipe_rule_catches_planted_receivers(tmp_path):
    readers = {"hl_core/config/views.py": "def view(recipe: Recipe):\n    return recipe.model\n",
               "hl_core/trainer.py": "class Trainer:\n    def __init__(self, recipe):\n        self.recipe = recipe\n",
               "hl_core/engines/base.py": "def build(spec: EngineSpec, tokenizer):\n    return spec.engine\n"}
    _plant(tmp_path, readers)
    assert recipe_receivers(tmp_path) == []
    _plant(tmp_path, {
        "hl_core/engines/base.py": "class E:\n    def __init__(self, recipe, tokenizer):\n        pass\n",
        "hl_core/preflight/plan.py": "def plan(shape: Optional[Recipe] = None):\n    pass\n",
        "hl_core/loop/post.py": "def run(fn: Callable[['Recipe'], None]):\n    pass\n",
        "hl_core/rollout/src.py": "class S:\n    def set(self, r):\n        self.recipe = r\n",
        "hl_core/models/speed.py": "check = lambda recipe: recipe.model\n",
    })
    assert recipe_receivers(tmp_path) == ["hl_core/engines/base.py:2 __init__(recipe)",
                                          "hl_core/loop/post.py:1 run(fn)", "hl_core/models/speed.py:1 lambda(recipe)",
                                          "hl_core/preflight/plan.py:1 plan(shape)", "hl_core/rollout/src.py:3 .recipe"]
