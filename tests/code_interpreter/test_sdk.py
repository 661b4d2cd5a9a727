"""The code interpreter server against the unmodified `e2b-code-interpreter` SDK."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import httpx
import pytest
from e2b import NotFoundException, SandboxException, TimeoutException
from e2b_code_interpreter import ExecutionError, OutputMessage, Result, Sandbox


def test_a_new_server_lists_python_and_javascript_contexts(sandbox: Sandbox) -> None:
    # Started with the server, as E2B's are: neither language's first cell waits for a kernel.
    contexts = sandbox.list_code_contexts()
    assert sorted(c.language for c in contexts) == ["javascript", "python"]
    assert {c.cwd for c in contexts} == {sandbox.run_code("import os; os.getcwd()").text}


def test_state_and_execution_counts(sandbox: Sandbox) -> None:
    first = sandbox.run_code("x = 41")
    second = sandbox.run_code("x + 1")
    assert second.text == "42"
    assert first.execution_count is not None
    assert second.execution_count == first.execution_count + 1


def test_streaming_callbacks(sandbox: Sandbox) -> None:
    stdout: list[OutputMessage] = []
    stderr: list[OutputMessage] = []
    results: list[Result] = []
    code = "import sys\nprint('one')\nprint('two', file=sys.stderr)\nprint('three')\n'done'"
    execution = sandbox.run_code(
        code, on_stdout=stdout.append, on_stderr=stderr.append, on_result=results.append
    )
    assert "".join(m.line for m in stdout) == "one\nthree\n"
    assert [m.line for m in stderr] == ["two\n"]
    assert all(m.error for m in stderr) and not any(m.error for m in stdout)
    # Unix nanoseconds, as the SDK documents.
    assert abs(stdout[0].timestamp / 1e9 - time.time()) < 600
    # A string's text without its quotes, as E2B's server gives it.
    assert [r.text for r in results] == ["done"]
    assert execution.logs.stdout == [m.line for m in stdout]


def test_error_has_name_value_and_traceback(sandbox: Sandbox) -> None:
    errors: list[ExecutionError] = []
    execution = sandbox.run_code("def f():\n    return 1 / 0\nf()", on_error=errors.append)
    assert execution.error is not None
    assert execution.error.name == "ZeroDivisionError"
    assert execution.error.value == "division by zero"
    # Jupyter's traceback without colours, as E2B's kernels give it.
    assert "return 1 / 0" in execution.error.traceback
    assert "\x1b[" not in execution.error.traceback
    assert errors == [execution.error]
    assert sandbox.run_code("1 + 1").text == "2"  # the context goes on


def test_env_vars_last_one_execution(sandbox: Sandbox) -> None:
    code = "import os; print(os.environ.get('AENV_CI_TEST'))"
    with_env = sandbox.run_code(code, envs={"AENV_CI_TEST": "yes"})
    assert with_env.logs.stdout == ["yes\n"]
    assert sandbox.run_code(code).logs.stdout == ["None\n"]


def test_env_vars_the_kernel_cannot_set_are_an_error_not_a_broken_stream(
    sandbox: Sandbox,
) -> None:
    refusing = (
        "import os\n"
        "class Refusing(dict):\n"
        "    def update(self, *args, **kwargs): raise OSError('no env here')\n"
        "kept, os.environ = os.environ, Refusing(os.environ)"
    )
    assert sandbox.run_code(refusing).error is None
    try:
        failed = sandbox.run_code("1", envs={"AENV_CI_TEST": "yes"})
    finally:
        sandbox.run_code("os.environ = kept")
    assert failed.error is not None and failed.error.name == "ExecutionSetupError"
    assert "no env here" in failed.error.value
    assert sandbox.run_code("1 + 1").text == "2"  # the context was released


def test_rich_results(sandbox: Sandbox) -> None:
    code = (
        "from IPython.display import HTML, Markdown, display\n"
        "display(Markdown('**m**'))\n"
        "HTML('<b>h</b>')"
    )
    markdown, html = sandbox.run_code(code).results
    assert markdown.markdown == "**m**" and not markdown.is_main_result
    assert html.html == "<b>h</b>" and html.is_main_result


def test_matplotlib_chart_arrives_as_png(sandbox: Sandbox) -> None:
    code = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()"
    execution = sandbox.run_code(code)
    assert execution.error is None
    [figure] = execution.results
    assert figure.png is not None
    assert base64.b64decode(figure.png).startswith(b"\x89PNG\r\n\x1a\n")


def test_dataframe(sandbox: Sandbox) -> None:
    code = "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})"
    [frame] = sandbox.run_code(code).results
    assert frame.is_main_result
    assert frame.html is not None and "<table" in frame.html
    # A list of values per column, as E2B's server gives a frame's data.
    assert frame.data == {"a": [1, 2], "b": ["x", "y"]}
    code = "pd.DataFrame({'t': pd.to_datetime(['2024-01-02', None]), 'n': [0.5, float('nan')]})"
    [frame] = sandbox.run_code(code).results
    assert frame.data == {"t": ["2024-01-02T00:00:00", None], "n": [0.5, None]}


def test_results_as_e2b_gives_them(sandbox: Sandbox) -> None:
    execution = sandbox.run_code("import os; os.environ['FOO'] = 'bar'; os.getenv('FOO')")
    assert execution.text == "bar"
    assert sandbox.run_code('"it\'s"').text == "it's"
    # Lists and dicts are JSON results too; their text is not cut short.
    [listed] = sandbox.run_code("import numpy as np; [1, {'a': np.int64(2)}, *range(2000)]").results
    assert listed.json == [1, {"a": 2}, *range(2000)]
    assert listed.text is not None and listed.text.endswith(" 1999]") and "..." not in listed.text
    assert sandbox.run_code("1 + 1").results[0].json is None


def test_contexts(sandbox: Sandbox, server_cwd: Path) -> None:
    work = server_cwd / "work"
    work.mkdir()
    context = sandbox.create_code_context(cwd=str(work))
    assert (context.language, context.cwd) == ("python", str(work))
    assert context.id in [c.id for c in sandbox.list_code_contexts()]
    assert sandbox.run_code("import os; os.getcwd()", context=context).text == str(work)
    sandbox.run_code("y = 'mine'", context=context)
    assert sandbox.run_code("y", context=context).text == "mine"
    assert sandbox.run_code("'y' in dir()").text == "False"  # the default context's state
    sandbox.restart_code_context(context)
    assert sandbox.run_code("'y' in dir()", context=context).text == "False"
    sandbox.remove_code_context(context)
    assert context.id not in [c.id for c in sandbox.list_code_contexts()]
    with pytest.raises(NotFoundException):
        sandbox.run_code("1", context=context)


def test_timeout_interrupts_the_kernel(sandbox: Sandbox) -> None:
    sandbox.run_code("kept = 'still here'")
    with pytest.raises(TimeoutException):
        sandbox.run_code("import time\nwhile True: time.sleep(0.1)", timeout=2)
    # The loop was interrupted, so the next cell runs; the state was kept.
    assert sandbox.run_code("kept", timeout=30).text == "still here"


def test_unsupported_language_is_refused(sandbox: Sandbox) -> None:
    supported = "python, bash, javascript, typescript, r, java"
    with pytest.raises(SandboxException, match=f'not supported; supported: {supported}"'):
        sandbox.run_code("1", language="cobol")


def test_bash(sandbox: Sandbox) -> None:
    assert sandbox.run_code("echo $((40 + 2))", language="bash").logs.stdout == ["42\n"]
    context = sandbox.create_code_context(language="bash")
    assert context.language == "bash"
    sandbox.run_code("KEPT='in this shell'", context=context)
    with_env = sandbox.run_code(
        'echo "$KEPT: $GREETING"', context=context, envs={"GREETING": "hi 'there'"}
    )
    assert with_env.logs.stdout == ["in this shell: hi 'there'\n"]
    assert sandbox.run_code('echo "[$GREETING]"', context=context).logs.stdout == ["[]\n"]
    # bash_kernel runs a terminal: stderr arrives as stdout, the exit code as the error.
    failed = sandbox.run_code("ls /nonexistent-dir", context=context)
    assert failed.error is not None and failed.error.value == "2"
    assert "No such file" in "".join(failed.logs.stdout)
    sandbox.remove_code_context(context)


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/execute", {"code": "1", "timeout": 5}, "field 'timeout' is not supported"),
        ("/execute", {"code": 1}, "code: Input should be a valid string"),
        ("/execute", {"code": "1", "context_id": "c", "language": "python"}, "not both"),
        ("/contexts", {"cwd": "/nonexistent/dir"}, "cannot start a kernel"),
        ("/execute", {"code": "1", "env_vars": {"A B": "1"}}, "not an env var name: 'A B'"),
        ("/execute", {"code": "1", "env_vars": {"A": "a\0"}}, "'A' holds a NUL byte"),
    ],
)
def test_bad_input_gets_json_errors(server_url: str, path: str, body: object, message: str) -> None:
    response = httpx.post(f"{server_url}{path}", json=body)
    assert response.status_code == 400
    assert message in response.json()["message"]
    assert response.json()["code"] == 400


def test_not_json_and_unknown_context(server_url: str) -> None:
    response = httpx.post(f"{server_url}/execute", content=b"{nope")
    assert (response.status_code, response.json()["code"]) == (400, 400)
    response = httpx.post(f"{server_url}/contexts/missing/restart")
    assert response.status_code == 404
    assert response.json() == {"code": 404, "message": "context 'missing' not found"}


def test_hundred_executions_in_a_row(sandbox: Sandbox) -> None:
    sandbox.run_code("n = 0")
    for _ in range(100):
        sandbox.run_code("n += 1")
    assert sandbox.run_code("n").text == "100"
