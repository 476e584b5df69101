"""The ``Engine`` interface is declared, and kept: each engine defines every abstract member with the declared
parameters, and nothing outside ``hl_core.engines`` reads an engine attribute the interface does not declare, nor
probes one with ``getattr``/``hasattr`` (checked on the source, without running an engine)."""

import ast
import importlib
import inspect

import pytest

from helpers import REPO
from hl_core.engines import ENGINES
from hl_core.engines.base import Engine

# where `engine` names a DeepSpeed engine of TRL's (hl_core.integrations.trl), not ours
NOT_OURS = ("hl_core/integrations/trl/",)
ENGINE_NAMES = ("engine",)  # `engine.x`, and `<anything>.engine.x` where the owner is `self` or `trainer`
OWNERS = ("self", "trainer")


def _engine_classes():
    for module, name in ENGINES.values():
        yield getattr(importlib.import_module(f"hl_core.engines.{module}"), name)


def _declared() -> set:
    names = set(dir(Engine))
    for klass in Engine.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
    return names


@pytest.mark.parametrize("engine", list(_engine_classes()), ids=lambda c: c.__name__)
def test_each_engine_defines_every_abstract_member_with_its_parameters(engine):
    assert Engine.__abstractmethods__ >= {"token_logps", "trained_module", "backward", "step", "save", "load",
                                          "save_hf", "local_grads", "skip_step", "weight_buckets"}
    assert not inspect.isabstract(engine), sorted(engine.__abstractmethods__)
    for name in sorted(Engine.__abstractmethods__):
        declared = inspect.signature(getattr(Engine, name)).parameters
        own = inspect.signature(getattr(engine, name)).parameters
        assert list(declared) == list(own)[:len(declared)], (engine.__name__, name, list(own))
        # extra parameters an engine adds must have defaults (callers pass only the declared ones)
        assert all(p.default is not inspect.Parameter.empty for p in list(own.values())[len(declared):])


def test_the_base_is_not_an_engine():
    with pytest.raises(TypeError, match="abstract"):
        Engine()


def _engine_reads(tree: ast.AST):
    """(line, attribute) of each attribute read on an engine, and (line, call) of each probe of one."""
    def is_engine(node) -> bool:
        if isinstance(node, ast.Name):
            return node.id in ENGINE_NAMES
        return (isinstance(node, ast.Attribute) and node.attr in ENGINE_NAMES and isinstance(node.value, ast.Name)
                and node.value.id in OWNERS)

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_engine(node.value):
            yield node.lineno, node.attr
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and node.args and is_engine(node.args[0])):
            yield node.lineno, ast.unparse(node)


def test_nothing_outside_the_engines_reads_an_undeclared_engine_attribute():
    declared, found = _declared(), []
    for root in ("hl_core", "launchers", "eval"):
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith("hl_core/engines/") or rel.startswith(NOT_OURS):
                continue
            for line, what in _engine_reads(ast.parse(path.read_text())):
                if what not in declared:
                    found.append(f"{rel}:{line}: {what}")
    assert not found, "engine attributes read but not declared on Engine (or probed):\n" + "\n".join(found)


def test_the_check_sees_a_probe_and_an_undeclared_read():
    tree = ast.parse("getattr(engine, 'tp', 1)\nself.engine.policy.module\ntrainer.engine.rank\nrecipe.engine.name")
    reads = [what for _, what in _engine_reads(tree)]
    assert "getattr(engine, 'tp', 1)" in reads and "policy" in reads and "rank" in reads
    assert "name" not in reads  # a recipe's engine section is not an engine
    assert "policy" not in _declared() and {"tp", "tp_rank", "pp", "pp_rank", "dp_rank", "optimizer"} <= _declared()
