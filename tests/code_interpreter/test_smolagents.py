"""smolagents' `E2BExecutor` (its E2B code executor, unmodified) against our code interpreter
server run locally, the SDK in debug mode as the other tests here: tools, a final answer and an
error reach the agent as smolagents expects. No node: docs/integrations.md says what a node
adds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from smolagents.default_tools import FinalAnswerTool
from smolagents.monitoring import AgentLogger, LogLevel
from smolagents.remote_executors import E2BExecutor
from smolagents.utils import AgentError


@pytest.fixture(scope="module")
def executor(server_url: str) -> Iterator[E2BExecutor]:
    executor = E2BExecutor([], AgentLogger(LogLevel.OFF), debug=True, sandbox_url=server_url)
    yield executor
    executor.cleanup()


def test_code_runs_and_the_final_answer_comes_back(executor: E2BExecutor) -> None:
    executor.send_tools({"final_answer": FinalAnswerTool()})
    executor.send_variables({"base": 6})
    printed = executor("print('thinking')\nanswer = base * 7")
    assert (printed.logs, printed.is_final_answer) == ("thinking\n", False)
    final = executor("final_answer(answer)")
    assert (final.output, final.is_final_answer) == (42, True)


def test_an_error_is_the_agents_error(executor: E2BExecutor) -> None:
    with pytest.raises(AgentError, match="ZeroDivisionError"):
        executor("1 / 0")
