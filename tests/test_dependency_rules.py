"""The project's layering, checked over its own source by parsing imports (``ast``): ``import x`` and
``from x import y``, relative imports resolved to absolute names, imports inside functions included, and
followed through the repository's own modules (importing ``a.b.c`` also runs ``a`` and ``a.b``).

* ``hl_core`` (the training core) imports nothing from ``eval`` or ``launchers``;
* ``hl_core.objectives`` (pure functions over log-ratios) reaches neither ``hl_core.engines`` nor ``hl_core.trainer``;
* ``hl_core.config`` (the recipe schema) reaches no engine: ``hl_core.engines``, ``deepspeed``, ``megatron``.
"""

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

from helpers import REPO

PACKAGES = ("hl_core", "eval", "launchers")
# (package whose modules are checked, forbidden modules: each with everything under it)
RULES = [
    ("hl_core", ("eval", "launchers")),
    ("hl_core.objectives", ("hl_core.engines", "hl_core.trainer")),
    ("hl_core.config", ("hl_core.engines", "deepspeed", "megatron")),
]


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


def imported_names(path: Path, module: str) -> Set[str]:
    """Absolute names of everything ``path`` (the module ``module``) imports, anywhere in the file. For
    ``from m import x`` both ``m`` and ``m.x`` are listed (``x`` may be a submodule)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


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


def violations(root: Path) -> List[str]:
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


def test_the_layering_holds():
    assert not violations(REPO), "\n".join(violations(REPO))


def test_the_rules_cover_every_package_they_name():
    modules = source_modules(REPO)
    for package, _ in RULES:
        assert package in modules, package  # a renamed package must not silently switch a rule off


def _plant(root: Path, files: Dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("files, expected", [
    ({"hl_core/trainer.py": "def post():\n    from eval.run_from_recipe import run_post_training_eval\n"},
     "hl_core.trainer: imports eval"),
    ({"hl_core/plan.py": "import launchers.run as run\n"}, "hl_core.plan: imports launchers"),
    ({"hl_core/objectives/dpo.py": "from ..engines import base\n"}, "hl_core.objectives.dpo: imports hl_core.engines"),
    ({"hl_core/objectives/__init__.py": "from .. import trainer\n"}, "hl_core.objectives: imports hl_core.trainer"),
    ({"hl_core/config/checks.py": "def check():\n    import deepspeed\n"}, "hl_core.config.checks: imports deepspeed"),
    ({"hl_core/config/load.py": "from megatron.core import parallel_state\n"}, "hl_core.config.load: imports megatron"),
    # through another module of the repository: objectives -> rollout -> engines
    ({"hl_core/objectives/grpo.py": "from ..rollout import needs_old_logps\n",
      "hl_core/rollout/__init__.py": "from ..engines.base import Engine\n"},
     "hl_core.objectives.grpo: imports hl_core.engines (via hl_core.objectives.grpo -> hl_core.rollout -> hl_core.engines)"),
])
def test_the_checker_catches_a_planted_import(tmp_path, files, expected):
    clean = {f"{p}/__init__.py": "" for p in PACKAGES + ("hl_core/objectives", "hl_core/config", "hl_core/rollout",
                                                       "hl_core/engines")}
    clean.update({"hl_core/engines/base.py": "", "eval/run_from_recipe.py": "", "launchers/run.py": ""})
    _plant(tmp_path, clean)
    assert violations(tmp_path) == []
    _plant(tmp_path, files)
    assert any(v.startswith(expected) for v in violations(tmp_path)), violations(tmp_path)
