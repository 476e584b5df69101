"""mkdocs hook: ``<!-- argparse: package.module -->`` in a page becomes that module's ``build_parser()`` help text, so
the command-line reference is generated from the parsers the commands use and cannot drift from them."""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!-- argparse: ([A-Za-z0-9_.]+) -->")


def parser_help(module: str) -> str:
    """``build_parser().format_help()`` of ``module``, at a fixed width."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ["COLUMNS"] = "110"
    return importlib.import_module(module).build_parser().format_help().rstrip()


def on_page_markdown(markdown, page=None, config=None, files=None, **_):
    return MARKER.sub(lambda m: "```text\n" + parser_help(m.group(1)) + "\n```", markdown)
