"""``python -m hl_core.config > docs/recipe-keys.md``: print the recipe key reference."""

from .keys_doc import recipe_keys_markdown

print(recipe_keys_markdown())
