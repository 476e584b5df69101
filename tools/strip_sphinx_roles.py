"""Rewrite Sphinx-isms in Python docstrings into the Google style that the docs site renders (mkdocstrings, griffe).

Two rewrites, only inside docstrings (a string literal standing alone as a statement: module, class, function and
attribute docstrings; and any triple-quoted literal, such as a docstring handed to a helper that sets ``__doc__``),
never in code, comments or other strings:

1. Roles: ``:class:`X```, ``:func:`X```, ``:meth:`X```, ``:attr:`X```, ``:mod:`X```, ``:data:`X```,
   ``:exc:`X```, ``:obj:`X``` (also ``:py:class:`` etc.) become plain ``X`` in backticks, with a leading ``~`` or
   ``.`` dropped (``:func:`.logits.token_logps``` -> ``logits.token_logps``; ``:class:`~a.b.C``` -> ``C``).
2. Grouped arguments in an ``Args:`` section, ``a, b: text``, become one entry per name (``a: text`` then
   ``b: text``, continuation lines repeated), which is what Google style and its table rendering expect.

Idempotent: a second run changes nothing. Usage (from the repository root; exit 0, prints the files it changed)::

    python tools/strip_sphinx_roles.py            # rewrite every tracked-looking *.py under the repository
    python tools/strip_sphinx_roles.py --check    # change nothing; exit 1 when a file would change
    python tools/strip_sphinx_roles.py PATH ...   # only these files or directories
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve()
SKIP_DIRS = {".git", "site", "build", "dist", "node_modules", "__pycache__", ".venv", "venv"}
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const|ref):`([^`\n]+)`")
ARGS_HEADER = re.compile(r"^(\s*)(Args|Arguments|Parameters|Keyword Args|Other Parameters)( \([^)]*\))?:\s*$")
GROUPED = re.compile(r"^(\s+)([A-Za-z_*][\w*]*(?:, [A-Za-z_*][\w*]*)+)( \([^)]*\))?: (.*)$")


def _role_target(match: re.Match) -> str:
    target = match.group(1).strip()
    if "<" in target and target.endswith(">"):  # :func:`title <target>`
        target = target[target.index("<") + 1:-1]
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target.lstrip('.')}`"


def strip_roles(text: str) -> str:
    """``text`` with every Sphinx role replaced by its target in backticks."""
    return ROLE.sub(_role_target, text)


def split_grouped_args(text: str) -> str:
    """``text`` with each grouped ``a, b: text`` entry of an ``Args:`` section split into one entry per name."""
    lines = text.split("\n")
    out, i, section_indent = [], 0, None
    while i < len(lines):
        line = lines[i]
        header = ARGS_HEADER.match(line)
        if header:
            section_indent = len(header.group(1))
            out.append(line)
            i += 1
            continue
        stripped_indent = len(line) - len(line.lstrip())
        if section_indent is not None and line.strip() and stripped_indent <= section_indent:
            section_indent = None  # the section ended (a new header or dedented prose)
        grouped = GROUPED.match(line) if section_indent is not None else None
        if grouped and len(grouped.group(1)) > section_indent:
            indent = len(grouped.group(1))
            block_end = i + 1
            while block_end < len(lines) and lines[block_end].strip() and \
                    len(lines[block_end]) - len(lines[block_end].lstrip()) > indent:
                block_end += 1
            continuation = lines[i + 1:block_end]
            for name in grouped.group(2).split(", "):
                out.append(f"{grouped.group(1)}{name}{grouped.group(3) or ''}: {grouped.group(4)}")
                out.extend(continuation)
            i = block_end
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _docstring_spans(source: str):
    """(start, end) character offsets of every docstring-like string literal in ``source``: a string statement,
    or a triple-quoted (non-f, non-bytes) literal anywhere, such as a docstring handed to a helper that sets
    ``__doc__``."""
    tree = ast.parse(source)
    starts = {(node.lineno, node.col_offset) for node in ast.walk(tree)
              if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
              and isinstance(node.value.value, str)}
    offsets = [0]
    for line in source.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        triple = token.string.lstrip("rRuU")[:3] in ('"""', "'''")
        if token.type == tokenize.STRING and (token.start in starts or triple):
            yield (offsets[token.start[0] - 1] + token.start[1], offsets[token.end[0] - 1] + token.end[1])


def convert_source(source: str) -> str:
    """``source`` with its docstrings rewritten (roles, grouped arguments); everything else byte for byte."""
    pieces, last = [], 0
    for start, end in _docstring_spans(source):
        pieces += [source[last:start], split_grouped_args(strip_roles(source[start:end]))]
        last = end
    pieces.append(source[last:])
    return "".join(pieces)


def _python_files(paths):
    for path in paths:
        if path.is_file() and path.suffix == ".py":
            yield path
        elif path.is_dir():
            for child in sorted(path.rglob("*.py")):
                if not SKIP_DIRS.intersection(child.relative_to(path).parts) and child.resolve() != SELF:
                    yield child  # (not this file: its docstring shows the roles it rewrites)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[ROOT])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a file would change")
    args = parser.parse_args(argv)
    changed = []
    for path in _python_files(args.paths):
        source = path.read_text(encoding="utf-8")
        try:
            converted = convert_source(source)
        except (SyntaxError, tokenize.TokenError) as err:
            print(f"{path}: skipped, not parseable ({err})", file=sys.stderr)
            continue
        if converted != source:
            changed.append(path)
            if not args.check:
                path.write_text(converted, encoding="utf-8")
    for path in changed:
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
