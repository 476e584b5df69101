"""mkdocs hooks (mkdocs.yml `hooks:`), each a Markdown rewrite before the page is rendered:

- ``<!-- argparse: package.module -->`` in a page becomes that module's ``build_parser()`` help text, so the
  command-line reference is generated from the parsers the commands use and cannot drift from them;
- list items written GitHub-style (continuation lines indented by the marker's width, 2 for ``- ``) are re-indented
  to the 4 columns Python-Markdown needs, so a table, code block or second paragraph inside an item stays in it and
  the next item is not run into the previous paragraph (GitHub renders both forms alike);
- a fenced code block whose lines all share extra indentation (a snippet cut out of a function body) is dedented,
  so it starts at the column's left edge instead of running off its right one;

and one HTML rewrite after it is rendered: each space-free run of inline code (outside code blocks) is kept on one
line (``<span class="nobreak">``), so inline code wraps only where it has a space, never inside a token.
(The API pages' signatures are code blocks, formatted one argument a line by ruff.)"""

from __future__ import annotations

import importlib
import os
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!-- argparse: ([A-Za-z0-9_.]+) -->")
ITEM = re.compile(r"^([-*+]|\d+\.) +(?=\S)")
FENCE = re.compile(r"^(\s*)(```|~~~)")


def parser_help(module: str) -> str:
    """``build_parser().format_help()`` of ``module``, at a fixed width."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ["COLUMNS"] = "110"
    return importlib.import_module(module).build_parser().format_help().rstrip()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def widen_list_items(markdown: str) -> str:
    """Top-level list items whose continuation lines are indented by the marker's width (``- `` then 2 spaces)
    re-indented to 4 spaces, with everything nested in them shifted alike; and a blank line put before an item
    that follows a multi-block item (else Python-Markdown reads it as that item's text). Fenced blocks outside
    items are untouched."""
    out, shift, width, fence, blocks = [], 0, None, None, False
    for line in markdown.split("\n"):
        fence_match = FENCE.match(line)
        if fence is not None and width is None:  # a top-level fenced block: copied as it is
            out.append(line)
            if fence_match and fence_match.group(2) == fence:
                fence = None
            continue
        if fence_match and width is None:
            fence = fence_match.group(2)
            out.append(line)
            continue
        item = ITEM.match(line) if fence is None else None
        if item:  # a new top-level item: its continuation style is decided by its first indented line
            if blocks and out and out[-1].strip():
                out.append("")
            width, shift, blocks = len(item.group(0)), None, False
        elif width is not None and line.strip() and _indent(line) == 0 and fence is None:
            width = shift = None  # a paragraph after the list
            blocks = False
        elif width is not None and line.strip():
            if shift is None:
                shift = max(0, 4 - width) if _indent(line) == width else 0
            if fence_match:
                fence = None if fence == fence_match.group(2) else fence_match.group(2)
            blocks = blocks or not out[-1].strip()  # an indented block after a blank line: a multi-block item
            line = " " * shift + line
        out.append(line)
    return "\n".join(out)


def dedent_fences(markdown: str) -> str:
    """Each fenced block's lines dedented by the indentation they share beyond the fence's own."""
    lines, out, i = markdown.split("\n"), [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        out.append(lines[i])
        i += 1
        if not opening:
            continue
        end = i
        while end < len(lines) and not (FENCE.match(lines[end]) and lines[end].strip() == opening.group(2)):
            end += 1
        pad = opening.group(1)
        body = [line[len(pad):] if line.startswith(pad) else line for line in lines[i:end]]
        if end > i:
            out += [pad + line if line.strip() else line for line in textwrap.dedent("\n".join(body)).split("\n")]
        out += lines[end:end + 1]  # the closing fence
        i = end + 1
    return "\n".join(out)


_INLINE_CODE = re.compile(r"<code>([^<]*)</code>")  # inline code holds text only; code blocks hold highlighting spans
_PRE = re.compile(r"<pre[\s>].*?</pre>", re.S)


def unbreakable_tokens(html: str) -> str:
    """``html`` with every space-free run of inline code inside ``<span class="nobreak">`` (CSS: no wrapping
    inside it); code blocks (``<pre>``) unchanged."""
    def inline(match):
        tokens = re.split(r"(\s+)", match.group(1))
        return "<code>" + "".join(t if not t or t.isspace() else f'<span class="nobreak">{t}</span>'
                                  for t in tokens) + "</code>"

    pieces, start = [], 0
    for block in _PRE.finditer(html):
        pieces += [_INLINE_CODE.sub(inline, html[start:block.start()]), block.group(0)]
        start = block.end()
    return "".join(pieces) + _INLINE_CODE.sub(inline, html[start:])


def on_page_content(html, page=None, config=None, files=None, **_):
    return unbreakable_tokens(html)


def on_page_markdown(markdown, page=None, config=None, files=None, **_):
    markdown = MARKER.sub(lambda m: "```text\n" + parser_help(m.group(1)) + "\n```", markdown)
    return dedent_fences(widen_list_items(markdown))
