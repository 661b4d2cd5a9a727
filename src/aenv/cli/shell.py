"""`aenv exec` (one command in a sandbox) and `aenv start` (a new sandbox with an interactive
shell), through the official `e2b` SDK pointed at the node, as any E2B client would."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import sys
import termios
import threading
import tty
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Annotated, TextIO

import typer

from aenv.cli.node import HomeOption, console, fail, node

if TYPE_CHECKING:  # the SDK is imported when a command needs it: other commands start faster
    from e2b import CommandHandle, PtySize, Sandbox

app = typer.Typer()

UserOption = Annotated[
    str | None, typer.Option(help="user to run as (default: the template's, `user`)")
]


@contextlib.contextmanager
def sdk_errors() -> Iterator[None]:
    """Anything the SDK raises (API errors, an unreachable node) ends the command in one line."""
    try:
        yield
    except typer.Exit:
        raise
    except Exception as e:  # the SDK has no common base class for its errors
        lines = str(e).strip().splitlines()
        fail(lines[0] if lines else type(e).__name__)


@app.command(
    "exec",
    # Everything after the sandbox ID is the command, options like `-la` included.
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def exec_command(
    sandbox_id: str,
    command: Annotated[list[str], typer.Argument(help="run by `bash -l -c`, as ssh does")],
    user: UserOption = None,
    cwd: Annotated[str | None, typer.Option(help="working directory")] = None,
    timeout: Annotated[int, typer.Option(help="seconds before it is killed; 0: never")] = 0,
    json_out: Annotated[
        bool, typer.Option("--json", help="print stdout, stderr and exit code as JSON at the end")
    ] = False,
    home: HomeOption = None,
) -> None:
    """Run a command in a sandbox: streams its stdout and stderr, exits with its exit code."""
    from e2b import CommandExitException, Sandbox

    with sdk_errors():
        sandbox = Sandbox.connect(sandbox_id, **node(home).sdk_options())
        handle = sandbox.commands.run(
            " ".join(command), background=True, user=user, cwd=cwd, timeout=timeout
        )
        try:
            result = handle.wait(
                on_stdout=None if json_out else _writer(sys.stdout),
                on_stderr=None if json_out else _writer(sys.stderr),
            )
        except CommandExitException as e:
            result = e
        except KeyboardInterrupt:
            handle.kill()
            raise typer.Exit(130) from None
    if json_out:
        body = {"stdout": result.stdout, "stderr": result.stderr, "exitCode": result.exit_code}
        typer.echo(json.dumps(body, indent=2))
    raise typer.Exit(result.exit_code)


def _writer(stream: TextIO) -> Callable[[str], None]:
    def write(chunk: str) -> None:
        stream.write(chunk)
        stream.flush()

    return write


@app.command()
def start(
    template: Annotated[str, typer.Argument(help="template ID or alias")] = "base",
    keep: Annotated[bool, typer.Option(help="leave the sandbox running after the shell")] = False,
    timeout: Annotated[int, typer.Option(help="sandbox lifetime in seconds")] = 3600,
    user: UserOption = None,
    home: HomeOption = None,
) -> None:
    """Create a sandbox and open a shell in it; the sandbox ends with the shell unless --keep."""
    from e2b import Sandbox

    with sdk_errors():
        with console.status(f"creating a sandbox from template {template}..."):
            sandbox = Sandbox.create(template, timeout=timeout, **node(home).sdk_options())
        console.print(f"sandbox [bold]{sandbox.sandbox_id}[/bold] (exit the shell to end it)")
        try:
            code = _shell(sandbox, user)
        finally:
            if keep:
                console.print(f"sandbox {sandbox.sandbox_id} keeps running")
            else:
                sandbox.kill()
    raise typer.Exit(code)


def _shell(sandbox: Sandbox, user: str | None) -> int:
    """Bridge the local terminal to a PTY in the sandbox until its shell exits; its exit code.

    Output and input are pumped by threads; the main thread waits for the end and applies
    terminal resizes, which SIGWINCH reports through a queue (`SimpleQueue.put` is safe in a
    signal handler)."""
    from e2b import CommandExitException

    events: queue.SimpleQueue[tuple[str, int | Exception | None]] = queue.SimpleQueue()
    handle = sandbox.pty.create(_size(), user=user, timeout=0)

    def output() -> None:
        try:
            result = handle.wait(on_pty=lambda data: _write_all(sys.stdout.fileno(), data))
            events.put(("exit", result.exit_code))
        except CommandExitException as e:
            events.put(("exit", e.exit_code))
        except Exception as e:  # handed to the main thread, which reports it
            events.put(("error", e))

    def ended(signum: int, _: FrameType | None) -> None:
        raise typer.Exit(128 + signum)  # the terminal went away: still clean up the sandbox

    stdin = sys.stdin.fileno()
    saved = termios.tcgetattr(stdin) if os.isatty(stdin) else None
    handlers = {
        signal.SIGWINCH: signal.signal(signal.SIGWINCH, lambda *_: events.put(("resize", None))),
        signal.SIGHUP: signal.signal(signal.SIGHUP, ended),
        signal.SIGTERM: signal.signal(signal.SIGTERM, ended),
    }
    try:
        if saved is not None:
            tty.setraw(stdin)  # every key, Ctrl-C included, goes to the remote shell
        threading.Thread(target=output, daemon=True).start()
        threading.Thread(target=_input, args=(sandbox, handle, stdin), daemon=True).start()
        while True:
            kind, value = events.get()
            if kind == "resize":
                sandbox.pty.resize(handle.pid, _size())
            elif isinstance(value, Exception):
                raise value
            else:
                assert isinstance(value, int)
                return value
    finally:
        if saved is not None:
            termios.tcsetattr(stdin, termios.TCSADRAIN, saved)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def _input(sandbox: Sandbox, handle: CommandHandle, stdin: int) -> None:
    """Local keystrokes to the PTY. At the end of a piped stdin the shell gets an EOF (Ctrl-D),
    so `echo cmd | aenv start` ends too."""
    while True:
        data = os.read(stdin, 4096)
        try:
            sandbox.pty.send_stdin(handle.pid, data or b"\x04")
        except Exception:  # the shell has exited; the output thread reports the end
            return
        if not data:
            return


def _size() -> PtySize:
    from e2b import PtySize

    columns, rows = shutil.get_terminal_size()
    return PtySize(rows=rows, cols=columns)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
