"""``python -m eval.math500 MODEL_DIR [--data FILE] [python -m eval flags]``: MATH500 only.

Same as ``python -m eval MODEL_DIR --math500 [FILE] ...`` (see ``python -m eval --help`` for the flags:
--samples, --temperature, --top-p, --max-new-tokens, --prompt, --backend, --batch-size, --limit, --output,
--offline).
"""

import sys

from eval.__main__ import main


def _argv(argv):
    argv = list(argv)
    data = None
    if "--data" in argv:
        i = argv.index("--data")
        data = argv[i + 1] if i + 1 < len(argv) else None
        del argv[i : i + 2]
    return argv[:1] + (["--math500", data] if data else ["--math500"]) + argv[1:]


if __name__ == "__main__":
    from hl_core.errors import UserError

    try:
        sys.exit(main(_argv(sys.argv[1:])))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
