"""The code-interpreter-v1 definition turns into the build the SDK would send: its COPY
sources exist (their files hash), its pip step installs what the server and the data stack
need, and its start command is our server, as root, with every language's kernel warm. And
its /etc/profile.d file keeps the venv on PATH for commands.run's login shells (through a
real envd, in a throwaway root)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Template

import aenv.code_interpreter
from aenv.code_interpreter.languages import LANGUAGES
from aenv.template_definition import DefinitionError, read_definition, sdk_template
from tests.envd.helpers import extra_envd, sandbox_for
from tests.support.js import TSLAB_VERSION

DIRECTORY = Path(aenv.code_interpreter.__file__).parent
DEFINITION = DIRECTORY / "template.yaml"


def test_definition_builds_the_server_and_the_data_stack() -> None:
    definition = read_definition(DEFINITION)
    assert definition["name"] == "code-interpreter-v1"
    build = json.loads(Template.to_json(sdk_template(definition, DIRECTORY)))
    copies = [s for s in build["steps"] if s["type"] == "COPY"]
    sources = ["requirements.txt", "*.py", "tslab_kernel.js", "aenv-ci.sh"]
    assert [c["args"][0] for c in copies] == sources
    assert all(len(c["filesHash"]) == 64 for c in copies)
    assert "aenv.code_interpreter" in build["startCmd"]
    # As root, as E2B's server and kernels run, with every language's default context warm.
    assert build["startCmd"].startswith("sudo -E env")
    [warm] = re.findall(r"--default-contexts (\S+)", build["startCmd"])
    assert sorted(warm.split(",")) == sorted(LANGUAGES)
    assert "/etc/profile.d/aenv-ci.sh" in [c["args"][1] for c in copies]
    assert "49999/health" in build["readyCmd"]
    # Sized for the data stack and six warm kernels (the default 512 MB build VM ran out of
    # memory with pip and one).
    assert (definition["cpuCount"], definition["memoryMB"]) == (2, 2048)
    requirements = (DIRECTORY / "requirements.txt").read_text()
    assert any("bash_kernel.install" in " ".join(s["args"]) for s in build["steps"])
    for package in ("jupyter_client", "ipykernel", "bash_kernel", "numpy", "pandas", "matplotlib"):
        assert f"\n{package}>=" in requirements
    # The other languages' kernels, as the host's tests install them (tests/support/js.py,
    # scripts/install-system-deps.sh, pyproject.toml).
    commands = " ".join(" ".join(s["args"]) for s in build["steps"] if s["type"] == "RUN")
    for package in ("nodejs", "npm", "r-base-core", "r-cran-irkernel", "openjdk-17-jdk-headless"):
        assert f" {package}" in commands
    assert f"tslab@{TSLAB_VERSION}" in commands and "code_interpreter.tslab_specs" in commands
    assert "\njjava==" in requirements


def test_start_command_names_the_template_env_again_past_sudo() -> None:
    """sudo drops PYTHONPATH even with -E (its env_delete list) and sets its own PATH: the
    server then ran without its package (`No module named 'aenv'`, the build's readyCmd
    waiting 30 min). Every variable of the template's env reaches the server through `env`."""
    definition = read_definition(DEFINITION)
    start = json.loads(Template.to_json(sdk_template(definition, DIRECTORY)))["startCmd"]
    names = [name for step in definition["steps"] for name in step.get("env", {})]
    assert names
    for name in names:
        assert f'"{name}=${name}"' in start


@pytest.mark.parametrize(
    "extra", ["memoryMb: 1024", "memoryMB: lots", "cpuCount: 0", "cpuCount: true"]
)
def test_definition_keys_and_sizes_are_checked(tmp_path: Path, extra: str) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(f"name: t\nfromTemplate: base\n{extra}\n")
    with pytest.raises(DefinitionError):
        read_definition(path)


@pytest.fixture(scope="module")
def envd_url() -> Iterator[str]:
    with extra_envd() as url:
        yield url


def test_login_shells_find_the_venv(envd_url: str) -> None:
    sandbox = sandbox_for(envd_url)
    # The venv and the profile.d file as the template puts them, PATH as its env sets it.
    venv = "/opt/aenv-ci/venv"
    sandbox.commands.run(f"python3 -m venv {venv}", user="root", timeout=120)
    profile = (DIRECTORY / "aenv-ci.sh").read_text()
    sandbox.files.write("/etc/profile.d/aenv-ci.sh", profile, user="root")
    path = f"{venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    # commands.run runs `bash -l`, whose /etc/profile sets PATH anew (Debian's, as the guest's).
    for user in ("user", "root"):
        found = sandbox.commands.run("command -v python pip", user=user, envs={"PATH": path})
        assert found.stdout.split() == [f"{venv}/bin/python", f"{venv}/bin/pip"]
        twice = sandbox.commands.run("bash -l -c 'echo $PATH'", user=user, envs={"PATH": path})
        assert twice.stdout.count(f"{venv}/bin") == 1
