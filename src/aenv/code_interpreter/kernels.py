"""Contexts: one Jupyter kernel each, with its language, working directory and state.

A context is what the SDKs create, list, restart and remove; the first context of each
language is its default, which code without a context runs in. Each context runs one
execution at a time (`lock`): a kernel's output is only told apart by the request it answers,
and the SDKs expect one cell's output per stream. A new Python context takes the spare kernel
(`spares`) when there is one.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import os
import uuid
from dataclasses import dataclass, field

from jupyter_client.kernelspec import KernelSpecManager

from aenv.code_interpreter import kernel as kernels
from aenv.code_interpreter.kernel import Kernel, run_silently
from aenv.code_interpreter.languages import ALIASES, LANGUAGES, Language
from aenv.code_interpreter.spares import Spares

# Only Python keeps a spare: it is the language most contexts are made for, and a spare costs
# a kernel's memory in every sandbox.
SPARE_LANGUAGES = ("python",)


class ContextNotFound(KeyError):
    """No context has this id."""


class UnsupportedLanguage(ValueError):
    """No kernel of this server runs the language."""


@dataclass
class Context:
    id: str
    language: str
    cwd: str
    kernel: Kernel
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    @property
    def kind(self) -> Language:
        return LANGUAGES[self.language]


def installed_languages() -> tuple[str, ...]:
    """The languages whose kernel is installed here (Jupyter's kernel search path)."""
    specs = KernelSpecManager().find_kernel_specs()
    return tuple(name for name, language in LANGUAGES.items() if language.kernel in specs)


def _enterable(cwd: str) -> None:
    """OSError unless the kernel (this server's user) can work in `cwd`."""
    if not os.path.isdir(cwd):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cwd)
    if not os.access(cwd, os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), cwd)


class ContextTable:
    def __init__(self, default_cwd: str, spares: bool = True) -> None:
        """`spares`: keep a spare kernel of each `SPARE_LANGUAGES` (`spares`)."""
        self.default_cwd = default_cwd
        self.languages = installed_languages()
        self._contexts: dict[str, Context] = {}
        self._defaults: dict[str, str] = {}  # language -> id of its default context
        # One default context per language: its first users wait for the one start.
        self._creating: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self.spares = Spares(
            [name for name in SPARE_LANGUAGES if spares and name in self.languages],
            lambda language: kernels.start(language, default_cwd),
        )

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
        cwd = cwd or self.default_cwd
        kernel = await self._spare(language, cwd) or await kernels.start(language, cwd)
        context = Context(str(uuid.uuid4()), language, cwd, kernel)
        self._contexts[context.id] = context
        return context

    async def _spare(self, language: str, cwd: str) -> Kernel | None:
        _enterable(cwd)
        kernel = await self.spares.take(language)
        if kernel is None or cwd == self.default_cwd:
            return kernel
        try:
            await run_silently(kernel.client, f"__import__('os').chdir({cwd!r})")
        except (RuntimeError, TimeoutError):
            # Whatever kept it out, a kernel started in `cwd` says it better.
            await kernel.stop()
            return None
        return kernel

    async def default(self, language: str | None) -> Context:
        """The language's default context, started on first use."""
        language = self._language(language)
        async with self._creating[language]:
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
            await kernels.restart(context.kernel, context.language)

    async def remove(self, context_id: str) -> None:
        context = self._contexts.pop(self.get(context_id).id)
        await context.kernel.stop()

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
        stops = [c.kernel.stop() for c in contexts]
        await asyncio.gather(self.spares.close(), *stops, return_exceptions=True)
