"""The sandbox's env vars (`Sandbox.create(envs=...)`) in every kernel, under an execution's own
and back, as E2B's tests check them per language; and a clone's kernels get their own sandbox's.

The server asks a real envd for them (one in a throwaway root, with an access token as every
node's sandbox has, given its env vars by `/init` as the node gives a sandbox's), with the
token the SDK sends; it runs in a UTS namespace of its own, so the test can give it another
hostname, as the node's envd does in a fork."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import httpx
import pytest
from e2b import ConnectionConfig
from e2b_code_interpreter import Execution, Sandbox

from tests.code_interpreter.conftest import running_server, unread_pipe
from tests.envd.helpers import ENVD_VERSION, extra_envd

TOKEN = "ci-env-token"
AUTH = {"X-Access-Token": TOKEN}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sandbox, str, int]]:
    cwd = tmp_path_factory.mktemp("ci-env")
    with extra_envd(f"--access-token={TOKEN}") as envd_url:
        # As the node's /init: the token stays (an /init without one would drop it).
        env = {"TEST_ENV_VAR": "supertest", "ONLY_HERE": "here"}
        init = {"envVars": env, "accessToken": TOKEN}
        response = httpx.post(f"{envd_url}/init", json=init, headers=AUTH, timeout=30)
        assert response.status_code == 204
        prefix = ["unshare", "--uts"]
        # The server's stdout as in a sandbox, where nobody may read it: putting env vars back
        # in a JavaScript kernel shows their values, which must not go there.
        with (
            unread_pipe() as stdout,
            running_server(cwd, prefix=prefix, envd_url=envd_url, stdout=stdout) as (url, pid),
        ):
            # As the SDK knows a sandbox it created: with envd's token, which run_code sends.
            sandbox = Sandbox(
                sandbox_id="debug_sandbox_id",
                sandbox_domain=None,
                envd_version=ENVD_VERSION,
                envd_access_token=TOKEN,
                traffic_access_token=None,
                connection_config=ConnectionConfig(debug=True, sandbox_url=url),
            )
            yield sandbox, envd_url, pid


def _text(execution: Execution) -> str:
    """What the cell gave: its result's text (R's are displays), else its stdout."""
    assert execution.error is None, execution.error
    texts = [r.text for r in execution.results if r.text is not None]
    return (texts[0] if texts else "".join(execution.logs.stdout)).strip()


# Per language: the code that reads TEST_ENV_VAR (E2B's tests' own).
READ = {
    "python": "import os; os.getenv('TEST_ENV_VAR')",
    "bash": "echo $TEST_ENV_VAR",
    "r": 'Sys.getenv("TEST_ENV_VAR")',
    "javascript": "process.env.TEST_ENV_VAR",
    "typescript": "process.env.TEST_ENV_VAR",
    "java": 'System.getProperty("TEST_ENV_VAR")',
}


@pytest.mark.parametrize("language", list(READ))
def test_sandbox_env_reaches_every_kernel(server: tuple[Sandbox, str, int], language: str) -> None:
    sandbox, _, _ = server
    text = _text(sandbox.run_code(READ[language], language=language))
    # R shows a character vector as `[1] "supertest"`.
    assert text.removeprefix("[1] ").strip('"') == "supertest"
    mine = sandbox.run_code(READ[language], language=language, envs={"TEST_ENV_VAR": "overwrite"})
    assert _text(mine).removeprefix("[1] ").strip('"') == "overwrite"
    again = _text(sandbox.run_code(READ[language], language=language))
    assert again.removeprefix("[1] ").strip('"') == "supertest"


# Per language: code that fails.
FAIL = {
    "python": "1 / 0",
    "bash": "false",
    "r": 'stop("boom")',
    "javascript": 'throw new Error("boom")',
    "typescript": 'throw new Error("boom")',
    "java": 'throw new IllegalStateException("boom")',
}


@pytest.mark.parametrize("language", ["python", "r", "javascript", "typescript", "java"])
def test_a_failed_cells_env_is_put_back(server: tuple[Sandbox, str, int], language: str) -> None:
    """The put-back runs after the response, also after an error (tslab then drops what
    reaches it for a while): the next cell, sent at once, sees the sandbox's value."""
    sandbox, _, _ = server
    failed = sandbox.run_code(FAIL[language], language=language, envs={"TEST_ENV_VAR": "mine"})
    assert failed.error is not None
    again = _text(sandbox.run_code(READ[language], language=language))
    assert again.removeprefix("[1] ").strip('"') == "supertest"


# Last: it changes the sandbox's env vars for the module's server.
def test_a_clone_gets_its_own_sandbox_env(server: tuple[Sandbox, str, int]) -> None:
    sandbox, envd_url, pid = server
    read = "import os; (os.getenv('TEST_ENV_VAR'), os.getenv('ONLY_HERE'), kept)"
    sandbox.run_code("kept = 'state'")
    assert sandbox.run_code(read).text == "('supertest', 'here', 'state')"
    # The clone's sandbox has other env vars, and the kernel its state.
    init = {"envVars": {"TEST_ENV_VAR": "clone"}, "accessToken": TOKEN}
    response = httpx.post(f"{envd_url}/init", json=init, headers=AUTH, timeout=30)
    assert response.status_code == 204
    subprocess.run(["nsenter", f"--uts=/proc/{pid}/ns/uts", "hostname", "ci-env-clone"], check=True)
    assert sandbox.run_code(read).text == "('clone', None, 'state')"
