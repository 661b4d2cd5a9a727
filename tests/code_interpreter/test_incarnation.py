"""Kernels cloned into another sandbox get fresh randomness and keep their state.

The server runs in a UTS namespace of its own, so the test can give it another hostname, as
the node's envd does when a fork or a snapshot's sandbox starts from a clone of it."""

from __future__ import annotations

import random
import subprocess
from collections.abc import Iterator

import numpy as np
import pytest
from e2b_code_interpreter import Sandbox

from tests.code_interpreter.conftest import running_server

SEEDED = "import random, numpy\nrandom.seed(7)\nnumpy.random.seed(7)"
DRAW = "(random.random(), float(numpy.random.random()))"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sandbox, int]]:
    cwd = tmp_path_factory.mktemp("ci-uts")
    with running_server(cwd, prefix=["unshare", "--uts"]) as (url, pid):
        yield Sandbox.create(debug=True, sandbox_url=url), pid


def _rename(pid: int, hostname: str) -> None:
    subprocess.run(["nsenter", f"--uts=/proc/{pid}/ns/uts", "hostname", hostname], check=True)


def _draw(sandbox: Sandbox) -> tuple[float, float]:
    text = sandbox.run_code(DRAW).text
    assert text is not None
    first, second = text.strip("()").split(", ")
    return float(first), float(second)


def test_a_new_hostname_reseeds_and_keeps_state(server: tuple[Sandbox, int]) -> None:
    sandbox, pid = server
    repeated = (random.Random(7).random(), float(np.random.RandomState(7).random_sample()))
    # The same sandbox: seeded generators repeat, as in any Python.
    sandbox.run_code(SEEDED + "\nx = 41")
    assert _draw(sandbox) == repeated
    # A clone: the state is kept, the generators are not the seeded ones any more.
    sandbox.run_code(SEEDED)
    _rename(pid, "aenv-clone-1")
    assert sandbox.run_code("x + 1").text == "42"
    first_clone = _draw(sandbox)
    assert first_clone[0] != repeated[0] and first_clone[1] != repeated[1]
    # Once per hostname: seeding again holds until the next one.
    sandbox.run_code(SEEDED)
    assert _draw(sandbox) == repeated
    sandbox.run_code(SEEDED)
    _rename(pid, "aenv-clone-2")
    assert _draw(sandbox) not in (repeated, first_clone)


def test_r_and_javascript_draw_afresh_in_a_clone(server: tuple[Sandbox, int]) -> None:
    sandbox, pid = server
    seeded = "set.seed(7); y <- 1; runif(1)"
    repeated = sandbox.run_code(seeded, language="r").results[0].text
    assert sandbox.run_code(seeded, language="r").results[0].text == repeated
    native = "console.log(Math.random.toString().includes('[native code]'))"
    # A context of its own: the default one started with the server, under an earlier hostname.
    js = sandbox.create_code_context(language="js")
    assert sandbox.run_code(native, context=js).logs.stdout == ["true\n"]
    sandbox.run_code("set.seed(7)", language="r")
    _rename(pid, "aenv-clone-r-js")
    assert sandbox.run_code("runif(1)", language="r").results[0].text != repeated
    assert sandbox.run_code("y + 1", language="r").results[0].text == "[1] 2"
    # V8 cannot be reseeded: Math.random draws from the guest's RNG in a clone.
    assert sandbox.run_code(native, context=js).logs.stdout == ["false\n"]
    draw = sandbox.run_code("console.log(Math.random())", context=js).logs.stdout
    assert 0 <= float(draw[0]) < 1
