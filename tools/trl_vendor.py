"""TRL's trainer test files, vendored unmodified in ``tests/trl_upstream/vendored``: check them, or take them again.

The files come from TRL's git repository (https://github.com/huggingface/trl, Apache-2.0) at the pinned commit
``COMMIT``. ``BLOBS`` holds each file's git blob id in that commit's tree (``git ls-tree COMMIT``), the hash git
itself gives a file's bytes, so anyone can check the copies against TRL's repository without trusting this repo.

* ``python3 tools/trl_vendor.py`` (no git needed): each vendored file hashes to its blob id, byte for byte.
* ``python3 tools/trl_vendor.py --repo PATH`` (a clone of TRL's repository): the commit's tree lists the same blob
  ids, and the files extracted from the commit (``git show COMMIT:PATH``) equal the vendored ones.
* ``python3 tools/trl_vendor.py --repo PATH --extract``: write the files again from the commit, then check.

Exit 0 when everything matches, 1 with the differing files named otherwise, 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

COMMIT = "f2cd57710ae345ea6428ae95363267fcf38a3dc8"  # 2026-07-24, "Async grpo OpenEnv harness rollout (#6420)"
UPSTREAM = "https://github.com/huggingface/trl"
VENDORED = Path(__file__).resolve().parents[1] / "tests" / "trl_upstream" / "vendored"
# vendored file -> (its path in TRL's repository, its git blob id at COMMIT)
BLOBS: Dict[str, tuple] = {
    "LICENSE": ("LICENSE", "f577b7741dfb5c6af119f250971549dd7750acb9"),
    "__init__.py": ("tests/__init__.py", "d2777dd0eb21a0ea67dce8775337a27ea8499da2"),
    "conftest.py": ("tests/conftest.py", "17e29bd3ab528f0548884b0c334c9e6c62ca6cdc"),
    "test_dpo_trainer.py": ("tests/test_dpo_trainer.py", "28a031803c03b40bc995f1707b0cd0cdf386ad11"),
    "test_grpo_trainer.py": ("tests/test_grpo_trainer.py", "3a46eb3d50d5709f50557632f110f41f239690bf"),
    "test_kto_trainer.py": ("tests/test_kto_trainer.py", "627921ecc856ac032103c6be319c72038bb1027e"),
    "testing_constants.py": ("tests/testing_constants.py", "7589117c85a06be131489b8a7b905f2162b3c14d"),
    "testing_utils.py": ("tests/testing_utils.py", "66ed16701ceb5e9e090dabc6ab02b8fc4d75c485"),
}


def git_blob_id(data: bytes) -> str:
    """The id git gives a file of these bytes (sha1 of ``blob <size>\\0`` and the bytes)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def check_copies(folder: Path = VENDORED) -> List[str]:
    """The vendored files that are missing or whose bytes are not the pinned blob's (empty: all match)."""
    problems = []
    for name, (_, blob) in BLOBS.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif git_blob_id(path.read_bytes()) != blob:
            problems.append(f"{name}: blob {git_blob_id(path.read_bytes())} is not the pinned {blob}")
    extra = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name not in BLOBS)
    problems += [f"{name}: not a vendored file (only TRL's files belong in {folder})" for name in extra]
    return problems


def _git(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True).stdout


def check_against_repo(repo: Path, extract: bool) -> List[str]:
    """Compare (or first re-extract) the vendored files with ``git show COMMIT:PATH`` from a clone of TRL."""
    problems = []
    for name, (upstream_path, blob) in BLOBS.items():
        listed = _git(repo, "ls-tree", COMMIT, upstream_path).decode().split()
        if len(listed) < 3 or listed[2] != blob:
            problems.append(f"{upstream_path}: the commit's tree lists {listed[2:3]}, not {blob}")
            continue
        data = _git(repo, "show", f"{COMMIT}:{upstream_path}")
        if extract:
            (VENDORED / name).write_bytes(data)
        if (VENDORED / name).read_bytes() != data:
            problems.append(f"{name}: differs from {COMMIT[:12]}:{upstream_path}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, help=f"a git clone of {UPSTREAM} holding commit {COMMIT[:12]}")
    parser.add_argument("--extract", action="store_true", help="write the files from the commit first (needs --repo)")
    args = parser.parse_args(argv)
    if args.extract and args.repo is None:
        parser.error("--extract takes the files from a clone of TRL's repository: give it with --repo PATH")
    VENDORED.mkdir(parents=True, exist_ok=True)
    problems = check_against_repo(args.repo, args.extract) if args.repo else []
    problems += check_copies()
    for line in problems:
        print(line)
    if not problems:
        print(f"{len(BLOBS)} vendored files are byte-identical to {UPSTREAM} at {COMMIT[:12]}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
