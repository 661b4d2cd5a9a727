"""JavaScript, TypeScript, R and Java through the unmodified SDK's `run_code(language=...)`,
with the kernels the template installs (tslab's jslab and tslab, Debian's IRkernel, JJava)
run for real."""

from __future__ import annotations

from pathlib import Path

from e2b_code_interpreter import Sandbox

from tests.code_interpreter.conftest import running_server


def test_javascript_state_output_env_and_errors(sandbox: Sandbox) -> None:
    language = "js"
    # Both of the SDK's names reach the same context.
    sandbox.run_code("var kept = 41;", language="javascript")
    execution = sandbox.run_code('console.log("hi"); kept + 1', language=language)
    assert execution.error is None, execution.logs
    # A cell's value is its result, as E2B's JavaScript kernel gives it, not a line of stdout.
    assert execution.logs.stdout == ["hi\n"]
    assert execution.text == "42" and execution.results[0].is_main_result
    assert sandbox.run_code("'a' + 'b'", language=language).text == "ab"
    awaited = sandbox.run_code("await Promise.resolve('Hello World!')", language=language)
    assert awaited.text == "Hello World!"
    assert sandbox.run_code("({a: [1]})", language=language).text == "{ a: [ 1 ] }"
    assert sandbox.run_code("var nothing = 1;", language=language).results == []
    code = "process.env.AENV_CI_TEST || 'default'"
    with_env = sandbox.run_code(code, language=language, envs={"AENV_CI_TEST": 'a "b"'})
    assert with_env.text == 'a "b"'
    assert sandbox.run_code(code, language=language).text == "default"
    thrown = sandbox.run_code('throw new RangeError("too far")', language=language).error
    assert thrown is not None
    assert (thrown.name, thrown.value) == ("RangeError", "too far")
    plain = sandbox.run_code('throw new Error("plain")', language=language).error
    assert plain is not None and (plain.name, plain.value) == ("Error", "plain")
    # tslab drops what reaches it just after an error: the next cell still runs.
    assert sandbox.run_code("kept", language=language).text == "41"


def test_typescript_is_type_checked(sandbox: Sandbox) -> None:
    typed = sandbox.run_code("const n: number = 6;\nconsole.log(n * 7);", language="ts")
    assert typed.error is None and typed.logs.stdout == ["42\n"]
    assert sandbox.run_code("n * 7", language="ts").text == "42"
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


def test_java_env_vars_are_system_properties(sandbox: Sandbox) -> None:
    # As E2B's Java kernel has them: the JVM's own environment is fixed at its start.
    code = 'System.getProperty("AENV_CI_TEST", "default")'
    with_env = sandbox.run_code(code, language="java", envs={"AENV_CI_TEST": 'a "b"\u00e9'})
    assert with_env.text == 'a "b"\u00e9'
    assert sandbox.run_code(code, language="java").text == "default"


def test_default_contexts_name_their_language(sandbox: Sandbox) -> None:
    for code, language in (("1", "js"), ("1", "ts"), ("1", "r"), ("1", "java")):
        assert sandbox.run_code(code, language=language).error is None
    languages = {c.language for c in sandbox.list_code_contexts()}
    assert {"javascript", "typescript", "r", "java"} <= languages


def test_the_templates_default_contexts_start_warm_and_count_from_one(tmp_path: Path) -> None:
    # As code-interpreter-v1 starts the server: every language's default context, each run once
    # (its output to nobody) before the server answers.
    everything = "python,javascript,typescript,r,java,bash"
    with running_server(tmp_path, default_contexts=everything) as (url, _):
        sandbox = Sandbox.create(debug=True, sandbox_url=url)
        languages = [c.language for c in sandbox.list_code_contexts()]
        assert sorted(languages) == sorted(everything.split(","))
        first = sandbox.run_code("1 + 1")
        assert (first.text, first.execution_count, first.logs.stdout) == ("2", 1, [])
        for language in ("js", "ts", "r"):
            execution = sandbox.run_code("1 + 1", language=language)
            assert [r.text for r in execution.results] == ["[1] 2" if language == "r" else "2"]
            assert execution.logs.stdout == []
