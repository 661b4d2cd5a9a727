from __future__ import annotations

from e2b import Sandbox


def test_commands_and_files_through_the_proxy() -> None:
    sandbox = Sandbox.create(envs={"GREETING": "hello"}, timeout=120)
    try:
        result = sandbox.commands.run('echo "$GREETING from $(id -un) in $PWD"')
        assert result.stdout == "hello from user in /home/user\n"
        assert sandbox.commands.run("echo $E2B_SANDBOX_ID").stdout.strip() == sandbox.sandbox_id
        sandbox.files.write("notes/a.txt", "data")
        assert sandbox.files.read("/home/user/notes/a.txt") == "data"
        assert [e.name for e in sandbox.files.list("notes")] == ["a.txt"]
    finally:
        sandbox.kill()


def test_clones_are_isolated_and_reseeded() -> None:
    a = Sandbox.create(timeout=120)
    b = Sandbox.create(timeout=120)
    try:
        a.files.write("/tmp/only-a", "x")
        assert not b.files.exists("/tmp/only-a")
        rand = "head -c 16 /dev/urandom | od -An -tx1"
        assert a.commands.run(rand).stdout != b.commands.run(rand).stdout
        boot = "cat /proc/sys/kernel/random/uuid"
        assert a.commands.run(boot).stdout != b.commands.run(boot).stdout
    finally:
        a.kill()
        b.kill()
