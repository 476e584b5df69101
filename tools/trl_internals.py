"""Print the TRL adapter's table of TRL and transformers internals (``hl_core.integrations.trl.internals``) as the
TRL page shows it; ``--check docs/howto/trl.md`` exits 1 when the page does not hold it verbatim.

    python3 tools/trl_internals.py                         # the Markdown, to paste into docs/howto/trl.md
    python3 tools/trl_internals.py --check docs/howto/trl.md
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's hl_core

from hl_core.integrations.trl.internals import markdown  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", metavar="PAGE", help="exit 1 unless PAGE holds the table verbatim")
    args = parser.parse_args()
    if args.check is None:
        print(markdown(), end="")
        return 0
    if markdown() in Path(args.check).read_text():
        return 0
    print(f"{args.check} does not hold the internals table: paste `python3 tools/trl_internals.py` into it",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
