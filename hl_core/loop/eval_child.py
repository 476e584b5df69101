"""``python -m hl_core.loop.eval_child TARGET RECIPE_JSON FINAL RESULT_JSON``: the post-training evaluations'
child process (``hl_core/loop/post_training.py`` starts it through ``hl_core/children.py``).

``TARGET`` is ``module:function`` or ``/path/to/script.py:function``; the function is called as
``function(recipe, Path(FINAL))`` with the recipe validated from ``RECIPE_JSON`` (the parent's, as
``config.recipe_to_json`` writes it: the keys it was given, so that validation sees the same), and its result
(JSON) is written to ``RESULT_JSON``. This process rebuilds the recipe as the launcher builds it from a file; the
parent's post-training phase carries that JSON unread. SIGTERM/SIGINT keep their defaults here: the parent sends
them to this process's group, and ends the group if it outlives them.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..children import watch_parent
from ..config.load import validate_recipe_dict


def load_target(target: str) -> Callable:
    """The function ``TARGET`` names (module and qualified name; a script's path for its module)."""
    module_name, _, qualname = target.rpartition(":")
    if module_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location("hl_post_training_target", module_name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    fn = module
    for part in qualname.split("."):
        fn = getattr(fn, part)
    return fn


def main(argv: Optional[Sequence[str]] = None) -> int:
    watch_parent()
    target, recipe_json, final, result_json = list(sys.argv[1:] if argv is None else argv)
    recipe = validate_recipe_dict(json.loads(Path(recipe_json).read_text()), source=recipe_json)
    result = load_target(target)(recipe, Path(final))
    Path(result_json).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
