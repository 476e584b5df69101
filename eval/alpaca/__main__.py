"""``python -m eval.alpaca MODEL_DIR [--data FILE] [--judge SPEC] [python -m eval flags]``: AlpacaEval only.

Same as ``python -m eval MODEL_DIR --alpaca [FILE] ...`` (see ``python -m eval --help``: --judge,
--reference-outputs, --lc-data, --no-length-control, --rm-mode, --alpaca-max-new-tokens,
--alpaca-temperature, --alpaca-limit, --backend, --output, --offline).
"""

import sys

from eval.__main__ import single_block_main

if __name__ == "__main__":
    from hl_core.errors import exit_on_user_error

    exit_on_user_error(single_block_main, "--alpaca", sys.argv[1:])
