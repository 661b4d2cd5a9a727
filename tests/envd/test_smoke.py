from e2b import Sandbox


def test_runs_as_user_in_home(sandbox: Sandbox) -> None:
    result = sandbox.commands.run("id -un; pwd; echo $HOME")
    assert result.stdout.split() == ["user", "/home/user", "/home/user"]
    assert result.exit_code == 0


def test_write_then_read(sandbox: Sandbox, workdir: str) -> None:
    info = sandbox.files.write(f"{workdir}/a.txt", "hello")
    assert info.path == f"{workdir}/a.txt"
    assert sandbox.files.read(f"{workdir}/a.txt") == "hello"
    entry = sandbox.files.get_info(f"{workdir}/a.txt")
    assert (entry.owner, entry.group, entry.size) == ("user", "user", 5)
