"""The key reference: docs/recipe-keys.md is generated from the schema (``python -m hl_core.config``)."""

from __future__ import annotations

from pydantic_core import PydanticUndefined

from .load import _list_item_model, _unwrap_model
from .schema import Recipe
from .sections import OBJECTIVE_CONFIGS


def _type_name(annotation) -> str:
    text = str(annotation) if getattr(annotation, "__origin__",
                                      None) is not None else getattr(annotation, "__name__", str(annotation))
    return text.replace("typing.", "").replace("NoneType", "null").replace("|", "\\|")


def recipe_keys_markdown() -> str:
    """Every recipe key with its type, default and description, as Markdown."""
    lines = [
        "# Recipe keys",
        "",
        "Generated from `hl_core/config/` by `python -m hl_core.config > docs/recipe-keys.md`; do not edit by hand.",
        "",
    ]
    # (key prefix, schema class, section title, keys documented elsewhere)
    queue = [("", Recipe, "recipe", ())]
    while queue:
        prefix, model, title, shown = queue.pop(0)
        rows = []
        for name, field in model.model_fields.items():
            key = f"{prefix}.{name}" if prefix else name
            if name in shown:
                continue
            if model is Recipe and name == "objective":
                queue += [("objective", cls, f"objective (name: {tag})", ()) for tag, cls in OBJECTIVE_CONFIGS.items()]
                continue
            sub = _unwrap_model(field.annotation)
            if sub is not None:
                queue.append((key, sub, key, ()))
                item = _list_item_model(field.annotation)  # a list form too (`data.train`'s mixture): its own keys
                if item is not None and item is not sub:
                    queue.append((f"{key}[i]", item, f"{key}[i] (as a list)", tuple(sub.model_fields)))
                continue
            if field.default is PydanticUndefined and field.default_factory is None:
                default = "**required**"
            else:
                default = f"`{field.default_factory() if field.default_factory is not None else field.default}`"
            rows.append(f"| `{key}` | `{_type_name(field.annotation)}` | {default} | {field.description or ''} |")
        lines += [f"## {title}", "", " ".join((model.__doc__ or "").split()), ""]
        if rows:
            lines += ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    return "\n".join(lines)
