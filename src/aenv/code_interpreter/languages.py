"""The languages the server runs, each with its Jupyter kernel and the code the server itself
sends that kernel: set-up after a start, fresh randomness in a clone (`incarnation`), and the
env vars of one execution, set and put back, in the kernel's own language."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aenv.code_interpreter.incarnation import RESEED_CODE
from aenv.code_interpreter.startup import STARTUP_CODE

# What an env var was before an execution set it; None: unset.
Previous = Mapping[str, str | None]
# Shell names: every kernel's language can set them.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Language:
    kernel: str  # its kernelspec's name
    startup: str | None
    reseed: str | None
    # None: the kernel cannot change its own env vars, and an execution with some is refused.
    set_env: Callable[[Mapping[str, str]], str] | None
    restore_env: Callable[[Previous], str] | None
    # How long the kernel aborts what it is sent after an error: the context waits that long.
    after_error_s: float = 0.0
    # Its env vars start as the server's (its process environment); False: they start unset
    # (Java's system properties).
    inherits_env: bool = True
    # A cell run (its output to nobody, `kernel.warm_up`) in a default context that starts with
    # the server: a kernel's first cell runs code paths (its compiler's, the JIT's, its display
    # of a value) that a later one finds ready, which under TCG costs seconds.
    warm_up: str = ""


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


def _js_set(env: Mapping[str, str]) -> str:
    # `void`: tslab prints a silent cell's value on its own stdout.
    return f"void Object.assign(process.env, {json.dumps(dict(env))});"


def _js_restore(previous: Previous) -> str:
    return " ".join(
        f"void delete process.env[{json.dumps(name)}];"
        if value is None
        else f"process.env[{json.dumps(name)}] = {json.dumps(value)};"
        for name, value in previous.items()
    )


# V8 seeds Math.random once per process and offers no way to reseed it: in a clone it is
# replaced by draws from the guest's RNG, which the node reseeds in every clone.
_JS_RESEED = (
    'Math.random = ((c) => () => c.randomBytes(4).readUInt32BE(0) / 4294967296)(require("crypto"));'
)


def _r_set(env: Mapping[str, str]) -> str:
    # A JSON string is an R string literal too (R reads \", \\, \n and \uXXXX alike).
    # Backquoted: an env var's name may start with '_', an R name may not.
    pairs = ", ".join(f"`{name}` = {json.dumps(value)}" for name, value in env.items())
    return f"invisible(Sys.setenv({pairs}))"


def _r_restore(previous: Previous) -> str:
    return "; ".join(
        f"invisible(Sys.unsetenv({json.dumps(name)}))"
        if value is None
        else f"invisible(Sys.setenv(`{name}` = {json.dumps(value)}))"
        for name, value in previous.items()
    )


def _java_set(env: Mapping[str, str]) -> str:
    # A JSON string is a Java string literal too; its \uXXXX escapes (read before the rest)
    # are never of a line break (json writes \n and \r).
    return " ".join(
        f"System.setProperty({json.dumps(name)}, {json.dumps(value)});"
        for name, value in env.items()
    )


def _java_restore(previous: Previous) -> str:
    return " ".join(
        f"System.clearProperty({json.dumps(name)});"
        if value is None
        else f"System.setProperty({json.dumps(name)}, {json.dumps(value)});"
        for name, value in previous.items()
    )


# The SDKs' language names. A language is served where its kernel is installed: the template
# installs Python's (ipykernel), Bash's (bash_kernel), JavaScript's and TypeScript's (tslab's
# jslab and tslab), R's (IRkernel) and Java's (JJava, on Debian's JDK).
LANGUAGES = {
    "python": Language(
        "python3", STARTUP_CODE, RESEED_CODE, _python_set, _python_restore, warm_up="0"
    ),
    # Bash 5.1+ draws SRANDOM from the guest's RNG, which the node reseeds in every clone.
    "bash": Language("bash", None, "RANDOM=$SRANDOM", _bash_set, _bash_restore),
    # tslab drops the requests that reach it within 200 ms of an error.
    "javascript": Language(
        "jslab", None, _JS_RESEED, _js_set, _js_restore, after_error_s=0.3, warm_up="0"
    ),
    "typescript": Language(
        "tslab", None, _JS_RESEED, _js_set, _js_restore, after_error_s=0.3, warm_up="0"
    ),
    "r": Language(
        "ir",
        None,
        'set.seed(readBin("/dev/urandom", "integer", 1L))',
        _r_set,
        _r_restore,
        warm_up="0",
    ),
    # JJava runs cells in the kernel's JVM, whose System.getenv() is fixed at its start: env
    # vars are system properties (`System.getProperty`), as E2B's Java kernel has them.
    # Reseeding: `new Random()` seeds itself from the clock; Math.random's shared generator,
    # once drawn from, would repeat in clones, and JShell code cannot reach it to reseed it.
    "java": Language(
        "java",
        None,
        None,
        _java_set,
        _java_restore,
        inherits_env=False,
        warm_up="0",
    ),
}

# Other names the SDKs document for a language (`run_code(language="js")`).
ALIASES = {"js": "javascript", "ts": "typescript"}
