"""One Jupyter kernel: started in a directory and set up for its language, restarted, told to
run code silently, stopped."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.manager import AsyncKernelManager

from aenv.code_interpreter import incarnation
from aenv.code_interpreter.languages import LANGUAGES

# A kernel imports IPython and ipykernel first: seconds natively, a minute or more in a
# guest under TCG, several on a busy host.
READY_TIMEOUT_S = 600.0


@dataclass
class Kernel:
    manager: AsyncKernelManager
    client: AsyncKernelClient
    # The sandbox it started in, then the one it last ran code in (`incarnation`).
    incarnation: str = field(default_factory=lambda: incarnation.current())
    # The sandbox whose env vars it was given (`sandbox_env`), None before its first execution,
    # and those env vars.
    env_for: str | None = None
    sandbox_env: dict[str, str] = field(default_factory=dict)

    async def stop(self) -> None:
        self.client.stop_channels()
        with contextlib.suppress(RuntimeError):
            await self.manager.shutdown_kernel(now=True)


async def start(language: str, cwd: str) -> Kernel:
    """A ready kernel of `language` in `cwd`. OSError when `cwd` is no directory it can enter,
    TimeoutError when it does not start in time."""
    manager = AsyncKernelManager(kernel_name=LANGUAGES[language].kernel)
    try:
        await manager.start_kernel(cwd=cwd)
    except BaseException:
        # Cancelled (a spare's start when the server closes) after its process was launched:
        # jupyter_client awaits again before it returns, and would leave the process running.
        if manager.has_kernel:
            with contextlib.suppress(RuntimeError):  # as `Kernel.stop`: the first error stands
                await manager.shutdown_kernel(now=True)
        raise
    kernel = Kernel(manager, manager.client())
    kernel.client.start_channels()
    try:
        await _ready(kernel, language)
    except BaseException:
        await kernel.stop()
        raise
    return kernel


async def restart(kernel: Kernel, language: str) -> None:
    """A fresh process for `kernel`, set up again: its state is gone."""
    await kernel.manager.restart_kernel(now=True)
    await _ready(kernel, language)
    kernel.incarnation = incarnation.current()
    kernel.env_for, kernel.sandbox_env = None, {}


async def _ready(kernel: Kernel, language: str) -> None:
    await kernel.client.wait_for_ready(timeout=READY_TIMEOUT_S)
    startup = LANGUAGES[language].startup
    if startup is not None:
        await run_silently(kernel.client, startup)


async def warm_up(client: AsyncKernelClient, code: str) -> None:
    """Run `code` as a cell that shows its value, to nobody: the kernel's display path is then
    ready for the first real cell. No history, so no execution count, in the kernels that
    keep the count by their history (ipykernel, IRkernel)."""
    await client.execute_interactive(
        code,
        store_history=False,
        allow_stdin=False,
        timeout=READY_TIMEOUT_S,
        output_hook=_nowhere,
    )


async def run_silently(client: AsyncKernelClient, code: str) -> None:
    """Run `code` without output, history or an execution count, and wait until it is done."""
    reply: dict[str, Any] = await client.execute_interactive(
        code,
        silent=True,
        store_history=False,
        allow_stdin=False,
        timeout=READY_TIMEOUT_S,
        output_hook=_nowhere,
    )
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"kernel set-up failed: {reply['content'].get('evalue')}")


def _nowhere(msg: dict[str, Any]) -> None:
    """An output hook that drops the cell's outputs. jupyter_client's default one writes them
    to this server's stdout: tslab shows a silent cell's value too, and in a sandbox that
    stdout is the template start command's pipe to envd, whose reader may be gone (a write
    then raises BrokenPipeError mid-execution) or slow (it blocks the event loop)."""
