"""``python -m eval.alpaca MODEL_DIR [--data FILE] [--judge SPEC] [python -m eval flags]``: AlpacaEval only.

Same as ``python -m eval MODEL_DIR --alpaca [FILE] ...`` (see ``python -m eval --help``: --judge,
--reference-outputs, --lc-data, --no-length-control, --rm-mode, --alpaca-max-new-tokens,
--alpaca-temperature, --alpaca-limit, --backend, --output, --offline).
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
    return argv[:1] + (["--alpaca", data] if data else ["--alpaca"]) + argv[1:]


if __name__ == "__main__":
    from hl_core.errors import UserError

    try:
        sys.exit(main(_argv(sys.argv[1:])))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
