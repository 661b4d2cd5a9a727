"""The code-interpreter-v1 definition turns into the build the SDK would send: its COPY
sources exist (their files hash), its pip step installs what the server and the data stack
need, and its start command is our server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from e2b import Template

import aenv.code_interpreter
from aenv.cli.templates import _definition, _template
from tests.support.js import TSLAB_VERSION

DIRECTORY = Path(aenv.code_interpreter.__file__).parent
DEFINITION = DIRECTORY / "template.yaml"


def test_definition_builds_the_server_and_the_data_stack() -> None:
    definition = _definition(DEFINITION)
    assert definition["name"] == "code-interpreter-v1"
    build = json.loads(Template.to_json(_template(definition, DIRECTORY)))
    copies = [s for s in build["steps"] if s["type"] == "COPY"]
    assert [c["args"][0] for c in copies] == ["requirements.txt", "*.py"]
    assert all(len(c["filesHash"]) == 64 for c in copies)
    assert "aenv.code_interpreter" in build["startCmd"]
    assert "49999/health" in build["readyCmd"]
    # Sized for the data stack (the default 512 MB build VM ran out of memory).
    assert (definition["cpuCount"], definition["memoryMB"]) == (2, 1024)
    requirements = (DIRECTORY / "requirements.txt").read_text()
    assert any("bash_kernel.install" in " ".join(s["args"]) for s in build["steps"])
    for package in ("jupyter_client", "ipykernel", "bash_kernel", "numpy", "pandas", "matplotlib"):
        assert f"\n{package}>=" in requirements
    # The other languages' kernels, as the host's tests install them (tests/support/js.py,
    # scripts/install-system-deps.sh, pyproject.toml).
    commands = " ".join(" ".join(s["args"]) for s in build["steps"] if s["type"] == "RUN")
    for package in ("nodejs", "npm", "r-base-core", "r-cran-irkernel", "openjdk-17-jdk-headless"):
        assert f" {package}" in commands
    assert f"tslab@{TSLAB_VERSION}" in commands and "tslab install" in commands
    assert "\njjava==" in requirements


@pytest.mark.parametrize(
    "extra", ["memoryMb: 1024", "memoryMB: lots", "cpuCount: 0", "cpuCount: true"]
)
def test_definition_keys_and_sizes_are_checked(tmp_path: Path, extra: str) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(f"name: t\nfromTemplate: base\n{extra}\n")
    with pytest.raises(typer.Exit):
        _definition(path)
