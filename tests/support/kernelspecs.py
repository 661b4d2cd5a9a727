"""The Jupyter kernelspecs of the code interpreter's languages for a server run on this host
(tests, benches), as the code-interpreter-v1 template installs them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from aenv.code_interpreter import tslab_specs
from tests.support.js import ensure_tslab


def kernelspecs(path: Path) -> Path:
    """A Jupyter data dir with the kernelspecs the template writes into its venv: bash_kernel's
    (`bash_kernel.install`) and the JavaScript and TypeScript ones (`tslab_specs`). R's comes
    with Debian's r-cran-irkernel, in the system's Jupyter path."""
    bash = path / "kernels" / "bash"
    bash.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "bash_kernel", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "bash", "language": "bash"}
    (bash / "kernel.json").write_text(json.dumps(kernel))
    tslab = ensure_tslab()
    if tslab is not None:
        tslab_specs.write(path / "kernels", tslab.parents[1] / "lib" / "node_modules" / "tslab")
    return path
