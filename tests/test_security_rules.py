"""The project's security rules, checked over its own source: checkpoints load with ``weights_only=True``,
YAML with ``safe_load``, no shell strings, and remote code only where a recipe key allows it."""

import ast

import pytest

from helpers import REPO

SOURCES = sorted(
    path for folder in ("hl_core", "launchers", "eval", "bench") for path in (REPO / folder).rglob("*.py")
)
FORBIDDEN_CALLS = ("yaml.load", "yaml.unsafe_load", "yaml.full_load", "os.system", "os.popen", "eval", "exec")


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def violations(path) -> list:
    """``line: rule`` for every call in ``path`` that breaks a rule."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        keywords = {kw.arg: kw.value for kw in node.keywords}
        if func == "torch.load" and not _is_true(keywords.get("weights_only")):
            found.append(f"{node.lineno}: torch.load without weights_only=True")
        if func in FORBIDDEN_CALLS:
            found.append(f"{node.lineno}: {func}()")
        if _is_true(keywords.get("shell")):
            found.append(f"{node.lineno}: shell=True")
        if _is_true(keywords.get("trust_remote_code")):
            found.append(f"{node.lineno}: trust_remote_code=True (it must come from a recipe key)")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_source_follows_the_security_rules(path):
    assert not violations(path), f"{path.relative_to(REPO)}: " + "; ".join(violations(path))


def test_the_checker_flags_each_rule(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os, subprocess, torch, yaml\n"
        "torch.load('a')\n"
        "torch.load('b', weights_only=False)\n"
        "yaml.load('c')\n"
        "subprocess.run('ls', shell=True)\n"
        "f(trust_remote_code=True)\n"
        "os.system('ls')\n"
        "torch.load('ok', weights_only=True)\n"
        "yaml.safe_load('ok')\n"
    )
    assert [v.split(":")[0] for v in violations(bad)] == ["2", "3", "4", "5", "6", "7"]
