"""Our code interpreter server in a VM, driven by the unmodified `e2b-code-interpreter` SDK
through the node's proxy on port 49999: the template is code-interpreter-v1's recipe with the
server's requirements carried in unpacked and compiled (this namespace has no route to PyPI;
the real template, src/aenv/code_interpreter/template.yaml, installs them with pip and adds the
data stack), its server started by the template's start command and saved running."""

from __future__ import annotations

import random
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Template, TimeoutException
from e2b_code_interpreter import OutputMessage, Sandbox

from tests.e2e.inner.test_template_build import _delete
from tests.support.ci_wheels import PROJECT, SITE, SITE_DIR

# The build unpacks the server's requirements and starts two kernels under TCG: minutes of setup
# on a slow host, more with another suite beside it.
pytestmark = pytest.mark.timeout(1800)

# The guest has Python but no pip: its requirements come unpacked and compiled, as one archive
# (tests/support/ci_wheels.py). Compiled, as pip would: the server's user cannot write bytecode
# there, and compiling IPython on every kernel start takes minutes under TCG.
UNPACK = f"tar -xzf /opt/aenv-ci/{SITE.name} -C /opt/aenv-ci && rm /opt/aenv-ci/{SITE.name}"


def _context(tmp_path: Path) -> Path:
    shutil.copy(SITE, tmp_path / SITE.name)
    package = tmp_path / "aenv"
    package.mkdir()
    (package / "__init__.py").write_text('"""The code interpreter server only."""\n')
    source = PROJECT / "src" / "aenv" / "code_interpreter"
    ignore = shutil.ignore_patterns("__pycache__", "*.yaml", "*.txt")
    shutil.copytree(source, package / "code_interpreter", ignore=ignore)
    return tmp_path


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    name = f"ci-{secrets.token_hex(3)}"
    context = _context(tmp_path_factory.mktemp("ci-context"))
    definition = (
        Template(file_context_path=str(context))
        .from_template("base")
        .copy(SITE.name, "/opt/aenv-ci/", user="root")
        .run_cmd(UNPACK, user="root")
        .copy("aenv", "/opt/aenv-ci/src/aenv/", user="root")
        .run_cmd("python3 -m compileall -q /opt/aenv-ci/src", user="root")
        .set_envs({"PYTHONPATH": f"/opt/aenv-ci/{SITE_DIR}:/opt/aenv-ci/src"})
        .set_start_cmd(
            "python3 -m aenv.code_interpreter --cwd /home/user",
            # One long readyCmd: the server is ready once its default and spare kernels are,
            # which under TCG may take longer than this suite's build_ready_timeout.
            "timeout 900 sh -c 'until curl -sf http://127.0.0.1:49999/health; do sleep 1; done'",
        )
    )
    # Its log shows in the test's output if the build fails. As much memory as the real
    # template (this server's guests have 256 MiB): in less, two kernels and the server push
    # their own code out of the guest's page cache, and under TCG every page read back is
    # translated again (minutes of a busy guest per cell).
    Template.build(
        definition,
        alias=name,
        memory_mb=1024,
        on_build_logs=lambda entry: print(entry.message),
    )
    try:
        yield name
    finally:
        _delete(name)


@pytest.fixture
def sandbox(template: str) -> Iterator[Sandbox]:
    # As long as the test may take: kernels start in over a minute each under TCG, more on a
    # loaded machine, and a sandbox that times out mid-test is killed under it.
    sandbox = Sandbox.create(template, timeout=900)
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_run_code_streams_state_errors_and_contexts(sandbox: Sandbox) -> None:
    lines: list[OutputMessage] = []
    sandbox.run_code("x = 41")
    execution = sandbox.run_code("print('hi')\nx + 1", on_stdout=lines.append)
    assert execution.text == "42"
    assert [m.line for m in lines] == ["hi\n"]
    error = sandbox.run_code("undefined_name").error
    assert error is not None and error.name == "NameError"
    # The template holds a spare kernel: no kernel start (minutes under TCG) is waited for.
    context = sandbox.create_code_context(cwd="/tmp")
    assert sandbox.run_code("import os; os.getcwd()", context=context).text == "/tmp"
    assert sandbox.run_code("import os; os.getcwd()").text == "/home/user"
    assert sandbox.run_code("import getpass; getpass.getuser()").text == "user"
    # Commands and code share the sandbox.
    sandbox.commands.run("echo from-a-command > /home/user/note.txt")
    assert sandbox.run_code("open('note.txt').read()").text == "from-a-command\\n"


def test_timeout_interrupts_and_state_survives_pause(sandbox: Sandbox) -> None:
    sandbox.run_code("kept = 'still here'")
    with pytest.raises(TimeoutException):
        sandbox.run_code("import time\nwhile True: time.sleep(0.1)", timeout=3)
    assert sandbox.run_code("kept", timeout=60).text == "still here"
    assert sandbox.pause() is True
    resumed = Sandbox.connect(sandbox.sandbox_id, timeout=300)
    assert resumed.run_code("kept + '!'").text == "still here!"


def test_kernel_state_forks_with_fresh_randomness(sandbox: Sandbox) -> None:
    # Seeded: without a reseed in each clone, every child would draw this same number.
    seeded = sandbox.run_code("import random\nrandom.seed(5)\nx = 41").error
    assert seeded is None
    forks = sandbox.fork(count=16, timeout=600)
    children = [c for c in forks if isinstance(c, Sandbox)]
    try:
        assert len(children) == 16, [c for c in forks if not isinstance(c, Sandbox)]
        draws = set()
        for child in children:
            assert child.run_code("x + 1", timeout=300).text == "42"
            draws.add(child.run_code("random.random()").text)
        assert len(draws) == 16
        # The parent is no clone: its generator goes on from its seed.
        assert sandbox.run_code("random.random()").text == repr(random.Random(5).random())
    finally:
        for child in children:
            child.kill()
