"""The languages the server runs, each with its Jupyter kernel and the code the server itself
sends that kernel: set-up after a start, fresh randomness in a clone (`incarnation`), and the
env vars of one execution, set and put back, in the kernel's own language."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aenv.code_interpreter.incarnation import RESEED_CODE
from aenv.code_interpreter.startup import STARTUP_CODE

# What an env var was before an execution set it; None: unset.
Previous = Mapping[str, str | None]


@dataclass(frozen=True)
class Language:
    kernel: str  # its kernelspec's name
    startup: str | None
    reseed: str | None
    set_env: Callable[[Mapping[str, str]], str]
    restore_env: Callable[[Previous], str]


def _python_set(env: Mapping[str, str]) -> str:
    return f"__import__('os').environ.update({dict(env)!r})"


def _python_restore(previous: Previous) -> str:
    return (
        "(lambda e, old: [e.pop(k, None) if v is None else e.__setitem__(k, v)"
        f" for k, v in old.items()])(__import__('os').environ, {dict(previous)!r})"
    )


def _bash_set(env: Mapping[str, str]) -> str:
    return "export " + " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items())


def _bash_restore(previous: Previous) -> str:
    return "; ".join(
        f"unset {name}" if value is None else f"export {name}={shlex.quote(value)}"
        for name, value in previous.items()
    )


# The SDKs' language names. A language is served where its kernel is installed: the template
# installs Python's (ipykernel) and Bash's (bash_kernel).
LANGUAGES = {
    "python": Language("python3", STARTUP_CODE, RESEED_CODE, _python_set, _python_restore),
    # Bash 5.1+ draws SRANDOM from the guest's RNG, which the node reseeds in every clone.
    "bash": Language("bash", None, "RANDOM=$SRANDOM", _bash_set, _bash_restore),
}
