"""One run of code in a context, streamed as NDJSON lines while the kernel produces them.

1. The context's lock is taken: its kernel runs one execution at a time. A kernel cloned
   into another sandbox (a fork) gets fresh randomness first (`incarnation`), and a kernel
   new to its sandbox that sandbox's env vars (`sandbox_env`).
2. The execution's env vars, if any, are set in the kernel (`os.environ` in Python), in the
   same silent cell as step 1's set-up. If that fails, the stream is one
   `ExecutionSetupError` error and its end: the response has begun by then, so an HTTP error
   is no longer possible.
3. The code runs; the kernel's IOPub messages answering this request become events, until
   the kernel goes idle (or dies), and then an error its reply alone reports.
4. The response ends; a task of its own then puts the env vars back as the sandbox has them
   (else as the kernel started with them) and releases the lock, so the client does not wait
   for another cell (in tslab a compile, seconds under TCG).

A client that goes away mid-run (the SDKs' `timeout`, a dropped connection) cancels the stream:
then a task of its own interrupts the kernel, restores the env vars and releases the lock,
since the cancelled stream cannot wait for anything any more. It waits for the interrupted
cell to end before the next execution may start: ipykernel would abort a request that arrives
while an interrupted cell is still unwinding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import re
from collections.abc import AsyncIterator, Coroutine, Iterable, Mapping
from typing import Any

from aenv.code_interpreter import events, incarnation
from aenv.code_interpreter.kernel import run_silently
from aenv.code_interpreter.kernels import Context
from aenv.code_interpreter.languages import ENV_NAME
from aenv.code_interpreter.sandbox_env import SandboxEnv

log = logging.getLogger(__name__)

# How often a quiet kernel is checked for being alive.
_POLL_S = 1.0
# How long an interrupted cell may take to end before the context is handed on regardless.
_INTERRUPT_WAIT_S = 30.0
_THROWN = re.compile(r"^((?:[A-Za-z_$][\w$]*)?(?:Error|Exception)): (.*)$", re.MULTILINE)
# How long the reply to an execution may lag its last output (the kernel is idle by then).
_REPLY_WAIT_S = 10.0
_background: set[asyncio.Task[None]] = set()


def _started_with(context: Context, name: str) -> str | None:
    # A kernel inherited this server's environment when it started.
    return os.environ.get(name) if context.kind.inherits_env else None


def _previous(context: Context, names: Iterable[str]) -> dict[str, str | None]:
    sandbox = context.kernel.sandbox_env
    return {name: sandbox.get(name, _started_with(context, name)) for name in names}


async def run(
    context: Context,
    code: str,
    env: Mapping[str, str],
    sandbox: SandboxEnv,
    token: str | None,
) -> AsyncIterator[bytes]:
    """`sandbox` gives the sandbox's env vars, asked of envd with the caller's `token`."""
    await context.lock.acquire()
    # Who releases the lock: this stream until it hands the context to a task of its own.
    handed_on = False
    msg_id: str | None = None
    try:
        try:
            await _prepare(context, env, sandbox, token)
        except (RuntimeError, TimeoutError) as e:
            # The response has begun (200, streaming): the failure can only be an event.
            yield events.line(events.error("ExecutionSetupError", str(e), []))
            _in_background(_put_back(context, env, after_error=False))
            handed_on = True
            yield events.line(events.END)
            return
        msg_id = context.kernel.client.execute(
            code, store_history=True, allow_stdin=False, stop_on_error=False
        )
        seen: list[events.Event] = []
        async for event in _outputs(context, msg_id):
            seen.append(event)
            yield events.line(event)
        if not any(e["type"] == "error" for e in seen):
            failure = await _reply_error(context, msg_id, seen)
            if failure is not None:
                seen.append(failure)
                yield events.line(failure)
        # The client has its whole execution: the env vars are put back and the context
        # released off its response, and the next execution waits for the lock.
        failed = any(e["type"] == "error" for e in seen)
        _in_background(_put_back(context, env, after_error=failed))
        handed_on = True
        yield events.line(events.END)
    finally:
        if not handed_on:
            _in_background(_recover(context, msg_id, env))


def _in_background(work: Coroutine[Any, Any, None]) -> None:
    task = asyncio.create_task(work)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _put_back(context: Context, env: Mapping[str, str], after_error: bool) -> None:
    """After an error, the pause the kernel needs (tslab drops what reaches it within 200 ms
    of one: the put-back too); the env vars as before the execution; the context released."""
    try:
        if after_error:
            await asyncio.sleep(context.kind.after_error_s)
        await _restore(context, env)
    except (RuntimeError, TimeoutError, OSError) as e:
        log.warning("context %s: env vars not put back: %s", context.id, e)
    finally:
        context.lock.release()


async def _prepare(
    context: Context, env: Mapping[str, str], sandbox: SandboxEnv, token: str | None
) -> None:
    """Fresh randomness in a kernel cloned into another sandbox, the sandbox's env in a kernel
    new to it, then the execution's env: one silent cell, since every cell costs a kernel
    (tslab most: it compiles each) a round of its own."""
    kernel = context.kernel
    kind = context.kind
    now = incarnation.current()
    cells: list[str] = []
    if kernel.incarnation != now and kind.reseed is not None:
        cells.append(kind.reseed)
    sandbox_env: dict[str, str] | None = None
    if kernel.env_for != now and kind.set_env is not None:
        sandbox_env = _given(await sandbox.get(token))
        cells.extend(_sandbox_env_cells(context, sandbox_env))
    if env and kind.set_env is not None:
        cells.append(kind.set_env(env))
    if cells:
        await run_silently(kernel.client, "\n".join(cells))
    kernel.incarnation = now
    if sandbox_env is not None:
        kernel.sandbox_env, kernel.env_for = sandbox_env, now


def _given(envs: Mapping[str, str]) -> dict[str, str]:
    # Names no kernel's language can set are left out (envd takes any name).
    return {k: v for k, v in envs.items() if ENV_NAME.fullmatch(k) and "\0" not in v}


def _sandbox_env_cells(context: Context, given: Mapping[str, str]) -> list[str]:
    """The code that gives the kernel the sandbox's env vars `given`, in place of those of the
    sandbox it was in."""
    kind = context.kind
    assert kind.set_env is not None and kind.restore_env is not None
    gone = {k: _started_with(context, k) for k in context.kernel.sandbox_env if k not in given}
    return [
        *([kind.restore_env(gone)] if gone else []),
        *([kind.set_env(given)] if given else []),
    ]


async def _restore(context: Context, env: Mapping[str, str]) -> None:
    if env and context.kind.restore_env is not None:
        previous = _previous(context, env)
        await run_silently(context.kernel.client, context.kind.restore_env(previous))


async def _recover(context: Context, msg_id: str | None, env: Mapping[str, str]) -> None:
    try:
        if msg_id is not None:
            await context.kernel.manager.interrupt_kernel()
            await asyncio.wait_for(_finished(context, msg_id), _INTERRUPT_WAIT_S)
        await _restore(context, env)
    except (RuntimeError, TimeoutError, OSError) as e:
        log.warning("context %s: recovery after a dropped execution failed: %s", context.id, e)
    finally:
        context.lock.release()


async def _outputs(context: Context, msg_id: str) -> AsyncIterator[events.Event]:
    while True:
        try:
            msg: dict[str, Any] = await context.kernel.client.get_iopub_msg(timeout=_POLL_S)
        except queue.Empty:
            if not await context.kernel.manager.is_alive():
                yield events.error("DeadKernelError", "the kernel died; restart the context", [])
                return
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        content = msg["content"]
        match msg["msg_type"]:
            case "stream":
                yield events.stream(content["name"], content["text"])
            case "execute_input":
                yield events.count(content["execution_count"])
            case "execute_result":
                yield events.result(content["data"], main=True)
            case "display_data":
                main = content.get("metadata", {}).get(events.MAIN_RESULT) is True
                yield events.result(content["data"], main=main)
            case "error":
                yield events.error(content["ename"], content["evalue"], content["traceback"])
            case "status" if content["execution_state"] == "idle":
                return


async def _reply_error(
    context: Context, msg_id: str, seen: list[events.Event]
) -> events.Event | None:
    """The error of an execution that the kernel reported only in its reply: tslab sends no
    IOPub error, only a reply with status "error" after writing the message to stderr."""
    while True:
        try:
            reply: dict[str, Any] = await context.kernel.client.get_shell_msg(timeout=_REPLY_WAIT_S)
        except queue.Empty:
            return None
        # Replies to earlier requests (interrupted cells, say) nobody waited for.
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    content = reply["content"]
    if content["status"] == "abort":
        return events.error("ExecutionAborted", "the kernel did not run the code", [])
    if content["status"] != "error":
        return None
    stderr = "".join(e["text"] for e in seen if e["type"] == "stderr").strip()
    if "ename" in content:
        return events.error(content["ename"], content["evalue"], content["traceback"])
    # Node prints an uncaught exception's stack, whose first "Name: message" line names it; a
    # type error has no such line and is all value.
    thrown = _THROWN.search(stderr)
    name, value = thrown.groups() if thrown else ("Error", stderr)
    return events.error(name, value, [stderr])


async def _finished(context: Context, msg_id: str) -> None:
    async for _ in _outputs(context, msg_id):
        pass


async def drain() -> None:
    """Wait for the background tasks still running (at shutdown): put-backs, recoveries."""
    with contextlib.suppress(Exception):
        await asyncio.gather(*_background)
