"""One rank of a rehearsal in this process (what ``--rehearse`` starts for each rank):
``python -m hl_core.rehearsal RECIPE [key=value ...] --rank R [--kernels auto|real|shapes] [--micro-batches N] [--json
PATH]``."""

import argparse
import sys

from ..children import watch_parent
from ..errors import EXIT_USER_ERROR, UserError
from . import KERNELS, rehearse


def main(argv=None) -> int:
    watch_parent()  # started by `--rehearse`: end with it, however it ends
    parser = argparse.ArgumentParser(prog="python -m hl_core.rehearsal", description=__doc__)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--kernels", choices=KERNELS, default="auto")
    parser.add_argument("--micro-batches", default=None, help="a whole number, or `all`")
    parser.add_argument("--json", default=None)
    args = parser.parse_intermixed_args(argv)
    try:
        micro = args.micro_batches if args.micro_batches in (None, "all") else int(args.micro_batches)
        return rehearse(args.recipe, args.overrides, args.rank, args.kernels, micro, args.json)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
