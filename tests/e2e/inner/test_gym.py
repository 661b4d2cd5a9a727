"""`aenv.sdk.gym.SandboxEnv` on a real VM, with the unmodified SDK: Gymnasium's own `check_env`
passes, a step observes its command (one out of time killed), and an episode's files are gone
after `reset`."""

from __future__ import annotations

from e2b import CommandResult, Sandbox
from gymnasium.utils.env_checker import check_env

from aenv.sdk.gym import TIMED_OUT, SandboxEnv
from tests.e2e.inner.conftest import LIFETIME


def _succeeded(sandbox: Sandbox, action: str, result: CommandResult) -> float:
    return float(result.exit_code == 0)


def _says_done(sandbox: Sandbox, action: str, result: CommandResult) -> bool:
    return "done" in result.stdout


def test_check_env_passes_and_reset_forgets_the_episode() -> None:
    env = SandboxEnv(
        prepare=lambda sandbox: sandbox.files.write("/home/user/prepared", "yes"),
        reward=_succeeded,
        done=_says_done,
        max_steps=3,
        timeout=LIFETIME,
        # check_env runs sampled actions: short random strings keep those quick.
        max_command=16,
    )
    snapshot_id = env.snapshot_id
    try:
        check_env(env, skip_render_check=True)

        assert env.reset(seed=1) == ({"stdout": "", "stderr": "", "exit_code": 0}, {"steps": 0})
        written = env.step("echo episode > /home/user/episode; cat /home/user/prepared")
        assert written == (
            {"stdout": "yes", "stderr": "", "exit_code": 0},
            1.0,
            False,
            False,
            {"steps": 1},
        )
        failed, reward, *_ = env.step("ls /home/user/nothing")
        assert (failed["exit_code"], reward) == (2, 0.0) and "No such file" in failed["stderr"]
        # A character outside the charset is replaced; `done` ends the episode before max_steps.
        last = env.step("printf 'h\\303\\251 '; echo done")
        assert last == (
            {"stdout": "h? done\n", "stderr": "", "exit_code": 0},
            1.0,
            True,
            False,
            {"steps": 3},
        )
        assert env.sandbox.files.exists("/home/user/episode")

        env.reset()
        assert not env.sandbox.files.exists("/home/user/episode")
        assert env.sandbox.files.read("/home/user/prepared") == "yes"
        truncated = [env.step("true")[3] for _ in range(3)]
        assert truncated == [False, False, True]

        # A command out of time is killed; its output so far is observed, with exit code 124.
        env.command_timeout = 5
        env.reset()
        slow, *_ = env.step("echo started; exec sleep 10000")
        assert slow == {"stdout": "started\n", "stderr": "", "exit_code": TIMED_OUT}
        assert env.step("! pgrep -f 'sleep 1000[0]'")[0]["exit_code"] == 0
    finally:
        env.close()
    env.close()  # again: nothing
    assert not env.sandbox.is_running()
    assert not Sandbox.delete_snapshot(snapshot_id)  # close deleted it
