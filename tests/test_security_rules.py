"""The project's security rules, checked over its own source.

Most are ruff's ``S`` rules (ruff.toml: no pickle, ``eval`` or ``exec``; YAML through ``safe_load`` only; no shell),
which ``python3 -m ruff check .`` enforces over every file. ``test_ruff_flags_each_security_rule`` plants one
offender per rule and checks that the project's configuration catches each. Ruff has no check for the other two
rules, so each is one test here that lists every offending file: checkpoints load with ``weights_only=True``, and
remote code runs only where a recipe key allows it (never a literal ``trust_remote_code=True``).
"""

import ast
import subprocess
import sys

from helpers import REPO

SOURCES = sorted(
    path for folder in ("hl_core", "launchers", "eval", "bench", "examples", "tools") for path in
    (REPO / folder).rglob("*.py")
)


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _calls(path):
    """``(line, callee, keywords)`` for every call in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            yield node.lineno, ast.unparse(node.func), {kw.arg: kw.value for kw in node.keywords}


def unsafe_torch_loads(path) -> list:
    """``file:line`` of every ``torch.load`` in ``path`` without ``weights_only=True``."""
    return [f"{path.name}:{line}" for line, func, keywords in _calls(path)
            if func == "torch.load" and not _is_true(keywords.get("weights_only"))]


def literal_remote_code(path) -> list:
    """``file:line`` of every call in ``path`` that passes ``trust_remote_code=True`` as a literal."""
    return [f"{path.name}:{line}" for line, _, keywords in _calls(path) if _is_true(keywords.get("trust_remote_code"))]


def offenders(rule) -> list:
    """Every ``path:line`` of the project's sources that breaks ``rule``."""
    return [f"{path.relative_to(REPO).parent}/{hit}" for path in SOURCES for hit in rule(path)]


def test_every_torch_load_is_weights_only():
    assert not offenders(unsafe_torch_loads), "torch.load without weights_only=True: " + ", ".join(
        offenders(unsafe_torch_loads))


def test_remote_code_comes_only_from_a_recipe_key():
    assert not offenders(literal_remote_code), "trust_remote_code=True (it must come from a recipe key): " + ", ".join(
        offenders(literal_remote_code))


def test_the_checkers_flag_each_rule(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\n"
        "torch.load('a')\n"
        "torch.load('b', weights_only=False)\n"
        "f(trust_remote_code=True)\n"
        "torch.load('ok', weights_only=True)\n"
        "g(trust_remote_code=recipe.model.trust_remote_code)\n"
    )
    assert unsafe_torch_loads(bad) == ["bad.py:2", "bad.py:3"]
    assert literal_remote_code(bad) == ["bad.py:4"]


RUFF_OFFENDERS = {  # ruff's rule code -> a line that breaks it
    "S102": "exec('x = 1')",
    "S301": "pickle.loads(b'')",
    "S307": "eval('1')",
    "S506": "yaml.load('a: 1')",
    "S602": "subprocess.run('ls', shell=True)",
    "S605": "os.system('ls')",
    "S606": "os.execv('/bin/ls', ['ls'])",
}


def test_ruff_flags_each_security_rule(tmp_path):
    """Each of ruff.toml's security rules catches its planted offender under the project's own configuration."""
    module = tmp_path / "hl_core" / "planted.py"  # a path the project's per-file ignores do not exempt
    module.parent.mkdir()
    module.write_text("import os\nimport pickle\nimport subprocess\n\nimport yaml\n\n"
                      + "".join(f"{line}\n" for line in RUFF_OFFENDERS.values()))
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--config", str(REPO / "ruff.toml"),
                           "--output-format", "concise", "--no-cache", str(module)],
                          capture_output=True, text=True, cwd=tmp_path)
    found = {code for code in RUFF_OFFENDERS if f" {code} " in proc.stdout}
    assert found == set(RUFF_OFFENDERS), f"ruff missed {set(RUFF_OFFENDERS) - found}:\n{proc.stdout}{proc.stderr}"
