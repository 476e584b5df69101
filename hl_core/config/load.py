"""Loading: YAML (``safe_load``), ``defaults:`` inheritance, ``a.b=c`` overrides, and validation whose
errors name the key path and the fix."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import RecipeError, did_you_mean
from ..storage.text import decode_utf8, non_regular_file, read_regular_bytes
from .schema import Recipe
from .sections import OBJECTIVE_CONFIGS, DPOObjective


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A key given twice in one YAML mapping (``first_line``, ``line``: 1-based)."""

    def __init__(self, key: Any, first_line: int, mark):
        self.key, self.first_line, self.line = key, first_line, mark.line + 1
        super().__init__(None, None, f"key `{key}` appears twice in one mapping (lines {first_line} and {self.line})",
                         mark)


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` semantics, except that a key given twice in one mapping raises
    `DuplicateKeyError` naming both lines (plain YAML silently keeps the last), and a document whose aliases
    expand past ``MAX_YAML_VALUES`` values raises `YAMLLimitError` before anything is built. Merge keys
    (``<<``) still merge and may be overridden."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: Dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:
                    continue  # an unhashable key: the base loader reports it
                if first is not key_node:
                    raise DuplicateKeyError(key, first.start_mark.line + 1, key_node.start_mark)
        return super().construct_mapping(node, deep=deep)

    def compose_document(self):
        node = super().compose_document()
        if node is not None and expanded_size(node, MAX_YAML_VALUES) > MAX_YAML_VALUES:
            raise YAMLLimitError(
                f"aliases (`*name`) expand to more than {MAX_YAML_VALUES:,} values (anchors that refer to each "
                "other multiply, or refer to themselves): building them would take all memory. Fix: write the values "
                "out, or nest fewer aliases"
            )
        return node


MAX_YAML_VALUES = 100_000  # values of one YAML document once its aliases are expanded; recipes hold a few hundred


class YAMLLimitError(yaml.YAMLError):
    """A YAML document beyond what a recipe can be: aliases expanding past ``MAX_YAML_VALUES``, or nesting past
    Python's recursion limit (the message completes "the YAML ...")."""


def expanded_size(root: yaml.Node, limit: int) -> int:
    """How many nodes ``root`` has once every alias is expanded (more than ``limit`` when it exceeds it or when an
    anchor contains itself). Each node is counted once per path to it, computed bottom-up over the node graph the
    composer built (aliases are shared nodes), without recursion."""
    sizes: Dict[int, int] = {}
    on_path = set()  # the ancestors of the node being visited: meeting one again is a cycle
    stack: List[Tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        children: List[yaml.Node] = []
        if isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        if finished:
            on_path.discard(id(node))
            sizes[id(node)] = min(limit + 1, 1 + sum(sizes[id(child)] for child in children))
        elif id(node) in on_path:
            return limit + 1
        elif id(node) not in sizes:
            on_path.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(root)]


def safe_load_unique(text: str) -> Any:
    """``yaml.safe_load`` refusing duplicate keys (see `UniqueKeyLoader`, a ``SafeLoader``), alias bombs
    and nesting deeper than Python's recursion limit (`YAMLLimitError`)."""
    loader = UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    except RecursionError:
        raise YAMLLimitError(
            f"nests lists or mappings deeper than about {sys.getrecursionlimit()} levels. Fix: a recipe is a few "
            "levels of groups and keys; repair the file"
        ) from None
    finally:
        loader.dispose()


def _read_yaml(path: Path) -> Dict[str, Any]:
    try:
        raw = read_regular_bytes(path, lambda kind: RecipeError(
            f"Recipe path `{path}` is {kind}, not a regular file: reading it would never end or would block (nothing "
            "was read). Fix: name a recipe YAML file."))
    except FileNotFoundError:
        raise RecipeError(f"Recipe file `{path}` not found. Fix: check the path (recipes live under recipes/).")
    except IsADirectoryError:
        raise RecipeError(f"Recipe path `{path}` is a directory, not a YAML file. Fix: name a recipe file in it.")
    except OSError as exc:
        raise RecipeError(f"Recipe file `{path}` cannot be read ({exc.strerror}). Fix: check the path and its "
                          f"permissions.")
    text = decode_utf8(raw, path, lambda where, detail: RecipeError(
        f"Recipe `{where}` is not UTF-8 text ({detail}). Fix: re-save the file as UTF-8."))
    try:
        data = safe_load_unique(text)
    except DuplicateKeyError as exc:
        raise RecipeError(
            f"Recipe `{path}:{exc.line}`: key `{exc.key}` is given twice in the same mapping (first at line "
            f"{exc.first_line}, again at line {exc.line}); YAML would silently keep only the second. "
            "Fix: remove or merge one of them."
        )
    except YAMLLimitError as exc:
        raise RecipeError(f"Recipe `{path}`: the YAML {exc}.")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError(f"Recipe `{where}` is not valid YAML ({problem}). Fix the syntax at that line.")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"Recipe `{path}` must be a YAML mapping of groups (model:, data:, ...), got "
                          f"{type(data).__name__}.")
    return data


def deep_merge(base: Dict[str, Any], override: Dict[str, Any]) -> Dict[str, Any]:
    """Recursively merge mappings; values in ``override`` win, lists are replaced whole."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _resolve_defaults(path: Path, stack: Tuple[Path, ...] = ()) -> Dict[str, Any]:
    path = path.resolve()
    if path in stack:
        chain = " -> ".join(str(p) for p in stack + (path,))
        raise RecipeError(f"`defaults:` inheritance loops ({chain}). Fix: remove one of the references.")
    data = _read_yaml(path)
    bases = data.pop("defaults", []) or []
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise RecipeError(f"`defaults` in `{path}` must be a list of recipe file paths (relative to that file).")
    merged: Dict[str, Any] = {}
    for base in bases:
        base_path = (path.parent / base)
        if not base_path.is_file():
            kind = non_regular_file(base_path)
            state = "is a directory" if base_path.is_dir() else f"is {kind}" if kind else "does not exist"
            raise RecipeError(
                f"`defaults` in `{path}` names `{base}`, which {state} at `{base_path}`. "
                "Fix: `defaults` lists recipe files, with paths relative to the recipe file."
            )
        merged = deep_merge(merged, _resolve_defaults(base_path, stack + (path,)))
    return deep_merge(merged, data)


def parse_override(text: str) -> Tuple[List[str], Any]:
    """``"train.lr=1e-5"`` -> ``(["train", "lr"], 1e-5)``; the value is parsed as YAML."""
    if "=" not in text:
        raise RecipeError(
            f"Command-line override `{text}` has no `=`. Fix: write overrides as `group.key=value`, e.g. "
            f"`train.lr=1e-5`."
        )
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(f"Command-line override `{text}` has an empty key part. Fix: e.g. `engine.zero_stage=3`.")
    try:
        value = safe_load_unique(raw) if raw.strip() else None
    except DuplicateKeyError as exc:
        raise RecipeError(f"Command-line override `{text}`: key `{exc.key}` is given twice. Fix: give it once.")
    except YAMLLimitError as exc:
        raise RecipeError(f"Command-line override `{key.strip()}=...`: the YAML {exc}.")
    except yaml.constructor.ConstructorError as exc:
        if not _has_tag(raw):
            return parts, raw  # e.g. a Jinja template `{{ x }}`, which YAML reads as an unhashable mapping key
        # a tag that safe_load does not build (`!!python/object...`, `!x`): kept as text, it would pass unnoticed
        raise RecipeError(
            f"Command-line override `{key.strip()}`: its value has a YAML tag that is not allowed ({exc.problem}); "
            "tags would build objects, and recipes hold plain values only. Fix: drop the tag, or quote the whole value "
            f"if you meant the text (`{key.strip()}='\"...\"'`)."
        )
    except yaml.YAMLError:
        value = raw  # not YAML at all (e.g. `a: b` unquoted): the text as it is
    return parts, value


def _has_tag(text: str) -> bool:
    """Whether the YAML ``text`` spells out a tag (``!x``, ``!!python/...``)."""
    try:
        return any(isinstance(token, yaml.TagToken) for token in yaml.scan(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError:
        return False


def apply_overrides(data: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    data = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if i == 0 and part == "objective" and isinstance(child, str):
                child = node[part] = {"name": child}  # `objective: kto` shorthand, then `objective.beta=...`
            if isinstance(child, list):
                raise RecipeError(
                    f"Override `{text}`: `{'.'.join(parts[: i + 1])}` is a list (e.g. a `data.train` mixture), so it "
                    f"has no `{parts[i + 1]}`. Fix: override the whole list, e.g. "
                    f"`{'.'.join(parts[: i + 1])}=[{{path: a.jsonl, weight: 0.7}}, {{path: b.jsonl, weight: 0.3}}]`."
                )
            if not isinstance(child, dict):
                raise RecipeError(
                    f"Override `{text}`: `{'.'.join(parts[: i + 1])}` is a value, not a group, so it has no "
                    f"`{parts[i + 1]}`."
                )
            node = child
        node[parts[-1]] = value
    return data


def _model_for_loc(loc: Sequence[Any], objective: Optional[str] = None):
    """The schema class at ``loc`` (``objective`` picks the objective's own class)."""
    if list(loc[:1]) == ["objective"]:
        model, loc = OBJECTIVE_CONFIGS.get(objective, DPOObjective), loc[1:]
    else:
        model = Recipe
    loc = list(loc)
    for i, part in enumerate(loc):
        if isinstance(part, int):
            continue  # an item of a list: `model` is already the item's class
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return None
        annotation = fields[part].annotation
        listed = i + 1 < len(loc) and isinstance(loc[i + 1], int)
        model = _list_item_model(annotation) if listed else _unwrap_model(annotation)
        if model is None:
            return None
    return model


def _list_item_model(annotation):
    """The class of a list's items in a field annotation (e.g. ``data.train``'s mixture sources)."""
    if getattr(annotation, "__origin__", None) is list:
        return _unwrap_model(annotation.__args__[0])
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _list_item_model(arg)
        if found is not None:
            return found
    return None


def _unwrap_model(annotation):
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _unwrap_model(arg)
        if found is not None:
            return found
    return None


def _key(loc: Sequence[Any]) -> str:
    """A location as the recipe writes it: `data.train[0].weight`."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _describe_error(err: Dict[str, Any]) -> str:
    loc, objective = list(err["loc"]), None
    if len(loc) >= 2 and loc[0] == "objective" and loc[1] in OBJECTIVE_CONFIGS:
        objective, loc = loc[1], ["objective", *loc[2:]]  # drop the union tag pydantic adds
    if loc[:2] == ["data", "train"] and len(loc) > 2 and loc[2] in ("source", "mixture"):
        del loc[2]  # the tag of `data.train`'s form (one source, or a mixture)
    key = _key(loc) or "(recipe)"
    kind = err["type"]
    given = err.get("input")
    if kind == "extra_forbidden":
        parent = _model_for_loc(loc[:-1], objective)
        choices = list(parent.model_fields) if parent else []
        hint = did_you_mean(str(loc[-1]), choices)
        known = f" Known keys here: {', '.join(choices)}." if choices else ""
        scope = f" for objective `{objective}`" if objective else ""
        if loc[:2] == ["data", "train"] and loc[-1] == "weight" and len(loc) == 3:
            hint = " A weight belongs to a source of a mixture: `data.train` as a list of sources with weights."
        return f"Unknown recipe key `{key}`{scope}.{hint}{known} Fix: remove it or correct the spelling."
    if kind == "missing":
        field = _model_for_loc(loc[:-1], objective)
        desc = ""
        if field is not None and loc[-1] in field.model_fields:
            desc = field.model_fields[loc[-1]].description or ""
        return (f"Missing required recipe key `{key}`" + (f" ({desc})" if desc else "")
                + f". Fix: add `{key}` to the recipe or its `defaults`.")
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    shown = repr(given) if not isinstance(given, dict) else "a mapping"
    return (f"Recipe key `{key}` is invalid: {msg} (got {shown}). Fix: correct `{key}` in the recipe or override it "
            f"with `{key}=...`.")


def validate_recipe_dict(data: Dict[str, Any], source: str = "recipe") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        first = _describe_error(errors[0])
        more = ""
        if len(errors) > 1:
            others = "; ".join(_describe_error(e) for e in errors[1:4])
            more = f" ({len(errors) - 1} more problem(s): {others})"
        raise RecipeError(f"{source}: {first}{more}")


def load_recipe(path: Union[str, Path], overrides: Sequence[str] = ()) -> Recipe:
    """Read, inherit, override and validate a recipe (no cross-field checks: see ``check_recipe``)."""
    path = Path(path)
    data = _resolve_defaults(path)
    data = apply_overrides(data, overrides)
    data.setdefault("name", path.stem)
    if "output_dir" not in data:
        data["output_dir"] = str(Path("runs") / data["name"])
    return validate_recipe_dict(data, source=str(path))


def recipe_to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def recipe_to_json(recipe: Recipe) -> Dict[str, Any]:
    """The recipe as JSON-serialisable data holding only the keys it was given (so that validating it again,
    ``validate_recipe_dict``, sees what the first validation saw and gives the same recipe): what a child process
    rebuilds it from (``hl_core/loop/eval_child.py``)."""
    return recipe.model_dump(mode="json", exclude_unset=True)
