"""A new user's first hour on a node started with its defaults, on a host whose resolver is
at a private address: the README's Python example as written, a template build that installs
a package from the (simulated) package registry, a sandbox whose domain rule reaches its name,
and `aenv doctor` without a failure."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from e2b import Sandbox, Template

from tests.e2e.first_contact.conftest import aenv
from tests.e2e.internet import APT_PACKAGE, APT_PACKAGE_FILE, PUBLIC
from tests.e2e.server_ns import REPO

# The registry's package index, in place of Debian's own sources (which it does not serve).
SOURCES = "/etc/apt/sources.list.d/registry.list"
APT = f"-o Dir::Etc::SourceList={SOURCES} -o Dir::Etc::SourceParts=/nonexistent"


def _readme_python_example() -> str:
    readme = (REPO / "README.md").read_text()
    found = re.search(r"Python \(`pip install e2b`\):\n\n```python\n(.*?)```", readme, re.S)
    assert found, "the README has no Python example"
    return found.group(1)


def test_the_readme_python_example_runs_as_written(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text(_readme_python_example())
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split()[-2:] == ["user", "hi"], done.stdout


def test_a_build_installs_from_the_package_registry() -> None:
    template = (
        Template()
        .from_template("base")
        .run_cmd(
            "echo 'deb [trusted=yes] http://deb.debian.org/debian ./' > " + SOURCES
            + f" && apt-get update --error-on=any {APT}"
            + f" && apt-get install -y {APT} {APT_PACKAGE}",
            user="root",
        )
    )  # fmt: skip
    Template.build(template, "first-contact")
    sandbox = Sandbox.create("first-contact", timeout=120)
    try:
        assert sandbox.commands.run(f"cat {APT_PACKAGE_FILE}").stdout == "installed\n"
    finally:
        sandbox.kill()


def test_a_domain_rule_reaches_its_name_and_nothing_else() -> None:
    sandbox = Sandbox.create(
        timeout=120, network={"allow_out": ["pypi.org"], "deny_out": ["0.0.0.0/0"]}
    )
    try:
        run = sandbox.commands.run
        assert run("curl -sS -m 10 http://pypi.org/").stdout == PUBLIC[0]
        blocked = run("curl -sS -m 5 http://allowed.test/ || echo blocked")
        assert blocked.stdout.strip().endswith("blocked")
    finally:
        sandbox.kill()


def test_doctor_finds_nothing_wrong() -> None:
    done = aenv("doctor", timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line.split()[1]: line for line in done.stdout.splitlines() if line.strip()}
    assert lines["dns"].startswith("pass") and "pypi.org" in lines["dns"], lines["dns"]
    assert lines["claims"].startswith("pass") and "this home's node runs" in lines["claims"]
