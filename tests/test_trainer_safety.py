"""The trainer owns its safety side (``hl_core.loop.safety.RunSafety``) rather than inheriting it: the safety object
reads only what it is given (its constructor's arguments and each call's ``Progress``), never a trainer attribute.
What it does (non-finite stops, checkpoints, ``final/``, resume) is tested end to end in tests/test_run_guard.py,
tests/test_resume.py and tests/test_checkpoint_files.py."""

import ast
import inspect

from helpers import REPO
from hl_core.loop.safety import RunSafety
from hl_core.trainer import Trainer


def test_the_trainer_inherits_no_safety_mixin():
    assert Trainer.__bases__ == (object,)


def test_the_safety_object_reads_only_what_it_is_given():
    tree = ast.parse((REPO / "hl_core" / "loop" / "safety.py").read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RunSafety")
    init = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assigned = {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for e in n.targets
                for t in (e.elts if isinstance(e, ast.Tuple) else [e]) if isinstance(t, ast.Attribute)}
    methods = {n.name for n in klass.body if isinstance(n, ast.FunctionDef)}
    read = {n.attr for n in ast.walk(klass) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self"}
    assert read <= assigned | methods, sorted(read - assigned - methods)
    # every argument is declared with its type
    params = inspect.signature(RunSafety.__init__).parameters
    assert all(p.annotation is not inspect.Parameter.empty for name, p in params.items() if name != "self")
