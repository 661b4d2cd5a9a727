"""A Gymnasium environment on one sandbox (`SandboxEnv`): an action is a shell command, its
observation the command's stdout, stderr and exit code, and `reset` returns the sandbox to a
snapshot in place (`aenv.sdk.reset`), so an episode costs no create and no kill.

Needs the `rl` extra (`pip install 'aenv[rl]'`: gymnasium). docs/integrations.md has the recipe.

    from aenv.sdk.gym import SandboxEnv

    env = SandboxEnv("base", prepare=lambda s: s.commands.run("pip install pytest"),
                     reward=lambda sandbox, action, result: float(result.exit_code == 0))
    observation, info = env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step("pytest -q")
    env.close()                             # kills the sandbox and the snapshot it took

Importing the module registers it with Gymnasium as `ENV_ID`, so
`gymnasium.make("aenv.sdk.gym:aenv/Sandbox-v0", template="base", ...)` builds one (wrapped in
Gymnasium's checks and order enforcement, as `make` wraps every environment).
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any, Unpack

import gymnasium
from e2b import ApiParams, CommandExitException, CommandResult, Sandbox, TimeoutException
from gymnasium import spaces

from aenv.sdk.calls import reset

# What a step's command left: the SDK's result (a non-zero exit is a result too, not an error).
Reward = Callable[[Sandbox, str, CommandResult], float]
Done = Callable[[Sandbox, str, CommandResult], bool]
Observation = dict[str, Any]

# The exit code of a command that ran out of time, as `timeout(1)` exits.
TIMED_OUT = 124
# A space holds only the characters of its charset; output outside it is replaced by this one.
REPLACEMENT = "?"


def no_reward(sandbox: Sandbox, action: str, result: CommandResult) -> float:
    """The default reward: none."""
    return 0.0


def never_done(sandbox: Sandbox, action: str, result: CommandResult) -> bool:
    """The default end of an episode: only `max_steps` ends it (truncated)."""
    return False


class SandboxEnv(gymnasium.Env[Observation, str]):
    """One sandbox as a Gymnasium environment.

    Built from `template` (then `prepare(sandbox)` runs, and a snapshot of the prepared state is
    taken: `close` deletes it), or from `snapshot_id`, a snapshot the caller keeps. `reset`
    restores that snapshot in place (the sandbox's id, URLs and token stay) and observes an
    empty output; every episode gets `timeout` seconds more of the sandbox's life.

    `step(command)` runs `command` in a shell for at most `command_timeout` seconds (then it is
    killed, and exits `TIMED_OUT` with the output it had printed). The observation is
    `{"stdout", "stderr", "exit_code"}`, each output cut to its last `max_output` characters,
    and a character outside `charset` replaced by `REPLACEMENT` (Gymnasium's Text spaces are of
    a finite charset). The reward is `reward(sandbox, command, result)`; the episode terminates
    when `done(...)` says so, and is truncated after `max_steps` steps. `sandbox` is the SDK's
    sandbox, for what a step cannot do (files, a reward that inspects them).

    `opts` are the SDK's connection options (`api_key`, `api_url`, ...), as for
    `Sandbox.create`."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        template: str = "base",
        *,
        snapshot_id: str | None = None,
        prepare: Callable[[Sandbox], object] | None = None,
        reward: Reward = no_reward,
        done: Done = never_done,
        max_steps: int = 100,
        command_timeout: float = 60,
        timeout: int = 3600,
        max_command: int = 4096,
        max_output: int = 16384,
        charset: str = string.printable,
        **opts: Unpack[ApiParams],
    ) -> None:
        if snapshot_id is not None and prepare is not None:
            raise ValueError("prepare is for a sandbox made from a template, not a snapshot")
        self.reward = reward
        self.done = done
        self.max_steps = max_steps
        self.command_timeout = command_timeout
        self.timeout = timeout
        self.max_output = max_output
        self.charset = frozenset(charset) | {REPLACEMENT}
        self.action_space = spaces.Text(max_command, charset=charset)
        text = spaces.Text(max_output, min_length=0, charset=self.charset)
        # Exit codes are 0-255; -1 is a command that ended without one (killed by a signal).
        codes = spaces.Discrete(257, start=-1)
        self.observation_space = spaces.Dict(stdout=text, stderr=text, exit_code=codes)
        self.steps = 0
        self._opts = opts
        self._closed = False
        self.sandbox = Sandbox.create(snapshot_id or template, timeout=timeout, **opts)
        self._owns_snapshot = snapshot_id is None
        try:
            if prepare is not None:
                prepare(self.sandbox)
            self.snapshot_id = snapshot_id or self.sandbox.create_snapshot().snapshot_id
        except BaseException:
            self.sandbox.kill()
            raise

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict[str, Any]]:
        """Restore the snapshot in place; the observation is an empty output. `seed` seeds
        `np_random` (the sandbox has no seed to take); `options` takes none."""
        if options:
            raise ValueError(f"reset takes no options: {', '.join(sorted(options))}")
        super().reset(seed=seed)
        reset(self.sandbox, self.snapshot_id, timeout=self.timeout)
        self.steps = 0
        return {"stdout": "", "stderr": "", "exit_code": 0}, {"steps": 0}

    def step(self, action: str) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        """Run `action` in a shell: its output, reward, terminated, truncated, the step count."""
        if not isinstance(action, str):
            raise TypeError(f"an action is a shell command (str), not {type(action).__name__}")
        result = self._run(action)
        self.steps += 1
        observation = {
            "stdout": self._observed(result.stdout),
            "stderr": self._observed(result.stderr),
            "exit_code": result.exit_code,
        }
        terminated = self.done(self.sandbox, action, result)
        truncated = not terminated and self.steps >= self.max_steps
        reward = float(self.reward(self.sandbox, action, result))
        return observation, reward, terminated, truncated, {"steps": self.steps}

    def _run(self, command: str) -> CommandResult:
        """The command's result; a non-zero exit is one, and so is running out of time."""
        handle = self.sandbox.commands.run(command, background=True, timeout=self.command_timeout)
        stdout: list[str] = []
        stderr: list[str] = []
        try:
            return handle.wait(on_stdout=stdout.append, on_stderr=stderr.append)
        except CommandExitException as exited:
            return CommandResult(exited.stderr, exited.stdout, exited.exit_code, exited.error)
        except TimeoutException:
            # The stream ended, the command did not: it would run on into the next step.
            handle.kill()
            error = f"timed out after {self.command_timeout} s"
            return CommandResult("".join(stderr), "".join(stdout), TIMED_OUT, error)

    def _observed(self, output: str) -> str:
        tail = output[-self.max_output :] if self.max_output else ""
        return "".join(c if c in self.charset else REPLACEMENT for c in tail)

    def close(self) -> None:
        """Kill the sandbox, and delete the snapshot if this environment took it. Again: nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self.sandbox.kill()
        finally:
            if self._owns_snapshot:
                Sandbox.delete_snapshot(self.snapshot_id, **self._opts)


# Nondeterministic: a command may read the clock or the guest's random source.
ENV_ID = "aenv/Sandbox-v0"
gymnasium.register(ENV_ID, entry_point=f"{__name__}:SandboxEnv", nondeterministic=True)
