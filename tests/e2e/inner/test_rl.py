"""What RL harnesses use beyond E2B's API, with the unmodified SDK against real VMs: a sandbox
reset in place to its snapshot (`aenv.sdk.reset`)."""

from __future__ import annotations

from e2b import Sandbox

from aenv.sdk import reset

SLEEPER = "'^sleep 10000[0]$'"


def test_reset_in_place_returns_to_the_snapshot_with_the_same_id_url_and_token() -> None:
    sandbox = Sandbox.create(timeout=300, metadata={"suite": "rl"})
    try:
        # A process started before the snapshot, holding a value only its memory has.
        sandbox.commands.run(
            "bash -c 'v=$RANDOM$RANDOM; echo $v > /tmp/value; exec sleep 100000'",
            background=True,
        )
        sandbox.commands.run("while [ ! -s /tmp/value ]; do sleep 0.05; done", timeout=120)
        value = sandbox.commands.run("cat /tmp/value").stdout
        snapshot = sandbox.create_snapshot()
        sandbox.files.write("/home/user/episode.txt", "written after the snapshot")
        # The pattern does not match the shell that runs pgrep or pkill itself.
        sandbox.commands.run(f"pkill -f {SLEEPER}", timeout=60)
        sandbox.commands.run(f"! pgrep -f {SLEEPER}", timeout=60)
        host = sandbox.get_host(49983)

        reset(sandbox, snapshot.snapshot_id)

        # The same SDK object, so the same id, URL and envd token, reaches the reset guest.
        assert sandbox.get_host(49983) == host
        assert not sandbox.files.exists("/home/user/episode.txt")
        assert sandbox.commands.run("cat /tmp/value").stdout == value
        assert sandbox.commands.run(f"pgrep -f {SLEEPER}").exit_code == 0
        info = sandbox.get_info()
        assert (info.sandbox_id, info.metadata) == (sandbox.sandbox_id, {"suite": "rl"})
        assert info.template_id == snapshot.snapshot_id
    finally:
        sandbox.kill()
