"""JavaScript, TypeScript, R and Java through the unmodified SDK's `run_code(language=...)`,
with the kernels the template installs (tslab's jslab and tslab, Debian's IRkernel, JJava)
run for real."""

from __future__ import annotations

import pytest
from e2b import SandboxException
from e2b_code_interpreter import Sandbox


def test_javascript_state_output_env_and_errors(sandbox: Sandbox) -> None:
    language = "js"
    # Both of the SDK's names reach the same context.
    sandbox.run_code("var kept = 41;", language="javascript")
    execution = sandbox.run_code('console.log("hi"); kept + 1', language=language)
    assert execution.error is None, execution.logs
    # tslab shows a cell's value on stdout.
    assert execution.logs.stdout == ["hi\n", "42\n"]
    code = "console.log(process.env.AENV_CI_TEST)"
    with_env = sandbox.run_code(code, language=language, envs={"AENV_CI_TEST": 'a "b"'})
    assert with_env.logs.stdout == ['a "b"\n']
    assert sandbox.run_code(code, language=language).logs.stdout == ["undefined\n"]
    thrown = sandbox.run_code('throw new RangeError("too far")', language=language).error
    assert thrown is not None
    assert (thrown.name, thrown.value) == ("RangeError", "too far")
    plain = sandbox.run_code('throw new Error("plain")', language=language).error
    assert plain is not None and (plain.name, plain.value) == ("Error", "plain")
    # tslab drops what reaches it just after an error: the next cell still runs.
    assert sandbox.run_code("kept", language=language).logs.stdout == ["41\n"]


def test_typescript_is_type_checked(sandbox: Sandbox) -> None:
    typed = sandbox.run_code("const n: number = 6;\nconsole.log(n * 7);", language="ts")
    assert typed.error is None and typed.logs.stdout == ["42\n"]
    mistyped = sandbox.run_code('const s: number = "six";', language="typescript").error
    assert mistyped is not None
    assert "Type 'string' is not assignable to type 'number'" in mistyped.value
    assert sandbox.run_code("console.log(n)", language="ts").logs.stdout == ["6\n"]


def test_r_results_env_and_errors(sandbox: Sandbox) -> None:
    sandbox.run_code("x <- 41", language="r")
    execution = sandbox.run_code('print("hi")\nx + 1', language="r")
    assert execution.logs.stdout == ['[1] "hi"\n']
    # IRkernel shows values as display data, as the SDK gets them from E2B's R kernel.
    assert [r.text for r in execution.results] == ["[1] 42"]
    code = 'Sys.getenv("_AENV_CI_TEST", unset = "none")'
    with_env = sandbox.run_code(code, language="r", envs={"_AENV_CI_TEST": "yes\n"})
    assert [r.text for r in with_env.results] == ['[1] "yes\\n"']
    assert [r.text for r in sandbox.run_code(code, language="r").results] == ['[1] "none"']
    error = sandbox.run_code('stop("boom")', language="r").error
    assert error is not None and "boom" in error.value


def test_java_state_results_and_errors(sandbox: Sandbox) -> None:
    sandbox.run_code("int kept = 41;", language="java")
    execution = sandbox.run_code('System.out.println("hi");\nkept + 1', language="java")
    assert execution.logs.stdout == ["hi\n"]
    assert execution.text == "42"
    error = sandbox.run_code('throw new IllegalStateException("bad")', language="java").error
    assert error is not None and "IllegalStateException" in error.value
    assert sandbox.run_code("kept", language="java").text == "41"


def test_java_refuses_env_vars_it_cannot_set(sandbox: Sandbox) -> None:
    with pytest.raises(SandboxException, match="java cannot set env vars"):
        sandbox.run_code("1", language="java", envs={"AENV_CI_TEST": "x"})


def test_default_contexts_name_their_language(sandbox: Sandbox) -> None:
    for code, language in (("1", "js"), ("1", "ts"), ("1", "r"), ("1", "java")):
        assert sandbox.run_code(code, language=language).error is None
    languages = {c.language for c in sandbox.list_code_contexts()}
    assert {"javascript", "typescript", "r", "java"} <= languages
