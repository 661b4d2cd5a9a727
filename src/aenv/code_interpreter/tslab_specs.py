"""The kernelspecs of the JavaScript (`jslab`) and TypeScript (`tslab`) kernels: tslab's, run
by `tslab_kernel.js` so that a cell's value is its result.

    python -m aenv.code_interpreter.tslab_specs <kernels directory> <tslab's package directory>
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

LAUNCHER = Path(__file__).with_name("tslab_kernel.js")


def write(kernels: Path, tslab: Path, node: str | None = None) -> None:
    """Write both specs into `kernels` (a Jupyter data directory's `kernels`), for tslab's
    package at `tslab`, run by `node` (the one on PATH when None)."""
    node = node or shutil.which("node")
    if node is None:
        raise FileNotFoundError("node is not on PATH")
    argv = [node, str(LAUNCHER), str(tslab), "--config-path", "{connection_file}"]
    for name, language, extra in (("jslab", "javascript", ["--js"]), ("tslab", "typescript", [])):
        spec = kernels / name
        spec.mkdir(parents=True, exist_ok=True)
        kernel = {"argv": [*argv, *extra], "display_name": name, "language": language}
        (spec / "kernel.json").write_text(json.dumps(kernel, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    write(Path(sys.argv[1]), Path(sys.argv[2]))
