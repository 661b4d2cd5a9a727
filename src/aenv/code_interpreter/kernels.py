"""Contexts: one Jupyter kernel each, with its language, working directory and state.

A context is what the SDKs create, list, restart and remove; the first context of each
language is its default, which code without a context runs in. Each context runs one
execution at a time (`lock`): a kernel's output is only told apart by the request it answers,
and the SDKs expect one cell's output per stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from aenv.code_interpreter import incarnation
from aenv.code_interpreter.languages import ALIASES, LANGUAGES, Language

# A kernel imports IPython and ipykernel first: seconds natively, a minute or more in a
# guest under TCG, several on a busy host.
_READY_TIMEOUT_S = 600.0


class ContextNotFound(KeyError):
    """No context has this id."""


class UnsupportedLanguage(ValueError):
    """No kernel of this server runs the language."""


@dataclass
class Context:
    id: str
    language: str
    cwd: str
    manager: AsyncKernelManager
    client: AsyncKernelClient
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The sandbox its kernel last ran in (`incarnation`).
    incarnation: str = field(default_factory=incarnation.current)

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    @property
    def kind(self) -> Language:
        return LANGUAGES[self.language]


async def _start(language: str, cwd: str) -> tuple[AsyncKernelManager, AsyncKernelClient]:
    manager = AsyncKernelManager(kernel_name=LANGUAGES[language].kernel)
    await manager.start_kernel(cwd=cwd)
    client = manager.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=_READY_TIMEOUT_S)
        await _set_up(client, LANGUAGES[language])
    except BaseException:
        client.stop_channels()
        await manager.shutdown_kernel(now=True)
        raise
    return manager, client


async def _set_up(client: AsyncKernelClient, language: Language) -> None:
    if language.startup is not None:
        await run_silently(client, language.startup)


async def run_silently(client: AsyncKernelClient, code: str) -> None:
    """Run `code` without output, history or an execution count, and wait until it is done."""
    reply: dict[str, Any] = await client.execute_interactive(
        code, silent=True, store_history=False, allow_stdin=False, timeout=_READY_TIMEOUT_S
    )
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"kernel set-up failed: {reply['content'].get('evalue')}")


def installed_languages() -> tuple[str, ...]:
    """The languages whose kernel is installed here (Jupyter's kernel search path)."""
    specs = KernelSpecManager().find_kernel_specs()
    return tuple(name for name, language in LANGUAGES.items() if language.kernel in specs)


class ContextTable:
    def __init__(self, default_cwd: str) -> None:
        self.default_cwd = default_cwd
        self.languages = installed_languages()
        self._contexts: dict[str, Context] = {}
        self._defaults: dict[str, str] = {}  # language -> id of its default context
        self._creating = asyncio.Lock()

    def list(self) -> list[Context]:
        return list(self._contexts.values())

    def get(self, context_id: str) -> Context:
        try:
            return self._contexts[context_id]
        except KeyError:
            raise ContextNotFound(context_id) from None

    async def create(self, language: str | None = None, cwd: str | None = None) -> Context:
        """A new context with a fresh kernel. UnsupportedLanguage for a language no kernel runs;
        OSError when `cwd` is not a directory."""
        language = self._language(language)
        manager, client = await _start(language, cwd or self.default_cwd)
        context = Context(str(uuid.uuid4()), language, cwd or self.default_cwd, manager, client)
        self._contexts[context.id] = context
        return context

    async def default(self, language: str | None) -> Context:
        """The language's default context, started on first use."""
        language = self._language(language)
        async with self._creating:
            context_id = self._defaults.get(language)
            if context_id in self._contexts:
                return self._contexts[context_id]
            context = await self.create(language)
            self._defaults[language] = context.id
            return context

    async def restart(self, context_id: str) -> None:
        """A fresh kernel for the context: its state is gone, its id and directory stay."""
        context = self.get(context_id)
        async with context.lock:
            await context.manager.restart_kernel(now=True)
            await context.client.wait_for_ready(timeout=_READY_TIMEOUT_S)
            await _set_up(context.client, context.kind)
            context.incarnation = incarnation.current()

    async def remove(self, context_id: str) -> None:
        context = self._contexts.pop(self.get(context_id).id)
        await _stop(context)

    def _language(self, language: str | None) -> str:
        name = (language or "python").lower()
        name = ALIASES.get(name, name)
        if name not in self.languages:
            raise UnsupportedLanguage(
                f"language {language!r} is not supported; supported: {', '.join(self.languages)}"
            )
        return name

    async def close(self) -> None:
        contexts, self._contexts = list(self._contexts.values()), {}
        await asyncio.gather(*(_stop(c) for c in contexts), return_exceptions=True)


async def _stop(context: Context) -> None:
    context.client.stop_channels()
    with contextlib.suppress(RuntimeError):
        await context.manager.shutdown_kernel(now=True)
