"""`python -m aenv.envd_bundle`: build (or reuse) the envd bundle and print its executable."""

from __future__ import annotations

import argparse
from pathlib import Path

from aenv.envd_bundle.build import DEFAULT_OUT, PREFIX, build_bundle


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m aenv.envd_bundle", description=__doc__)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="bundle directory")
    p.add_argument("--prefix", default=PREFIX, help="where the guest mounts the bundle")
    p.add_argument("--force", action="store_true", help="rebuild even if inputs are unchanged")
    args = p.parse_args()
    print(build_bundle(args.out, prefix=args.prefix, force=args.force))


main()
