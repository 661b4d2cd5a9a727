from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time

from e2b import Sandbox

from tests.support.wait import eventually_sync


def aenv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aenv.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_ls_info_timeout_rm() -> None:
    sandbox = Sandbox.create(metadata={"cli": "yes"}, timeout=120)
    listed = json.loads(aenv("ls", "--json").stdout)
    assert sandbox.sandbox_id in [s["sandboxID"] for s in listed]
    detail = json.loads(aenv("info", sandbox.sandbox_id, "--json").stdout)
    assert detail["metadata"] == {"cli": "yes"} and "envdAccessToken" not in detail
    before = sandbox.get_info().end_at
    assert aenv("timeout", sandbox.sandbox_id, "600").returncode == 0
    assert sandbox.get_info().end_at > before
    removed = aenv("rm", sandbox.sandbox_id)
    assert removed.returncode == 0 and removed.stdout.strip() == sandbox.sandbox_id
    missing = aenv("info", sandbox.sandbox_id)
    assert missing.returncode == 1 and "404" in missing.stderr


def test_template_ls_and_rm_of_an_unknown_template() -> None:
    listed = json.loads(aenv("template", "ls", "--json").stdout)
    assert "base" in [alias for t in listed for alias in t["aliases"]]
    assert "base" in aenv("template", "ls").stdout
    missing = aenv("template", "rm", "no-such-template")
    assert missing.returncode == 1
    assert missing.stderr.strip() == "404: template 'no-such-template' not found"


def test_exec_and_logs() -> None:
    sandbox = Sandbox.create(timeout=120)
    sandbox_id = sandbox.sandbox_id
    try:
        ran = aenv("exec", sandbox_id, "echo out-$((6*7)); echo err >&2; exit 3")
        assert (ran.returncode, ran.stdout, ran.stderr) == (3, "out-42\n", "err\n")
        # Everything after the ID is the command, its options included.
        listed = aenv("exec", sandbox_id, "ls", "-d", "/tmp")
        assert (listed.returncode, listed.stdout) == (0, "/tmp\n")
        as_json = json.loads(aenv("exec", "--json", "--user", "root", sandbox_id, "id -un").stdout)
        assert as_json == {"stdout": "root\n", "stderr": "", "exitCode": 0}

        # The logs are the guest console, which root can write to (the UART sends it on later).
        aenv("exec", "--user", "root", sandbox_id, "echo cli-log-1 > /dev/console")
        eventually_sync(
            lambda: aenv("logs", sandbox_id).stdout.endswith("  cli-log-1\n"),
            "the sandbox's log line reached `aenv logs`",
            interval=0.5,
        )
        entries = json.loads(aenv("logs", "--json", sandbox_id).stdout)
        assert entries[-1]["message"] == "cli-log-1"

        # --follow prints new lines as they come and ends with the sandbox.
        follow = subprocess.Popen(
            [sys.executable, "-m", "aenv.cli", "logs", "--follow", sandbox_id],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert follow.stdout is not None
            assert any(line.endswith("  cli-log-1\n") for line in follow.stdout)
            aenv("exec", "--user", "root", sandbox_id, "echo cli-log-2 > /dev/console")
            assert follow.stdout.readline().endswith("  cli-log-2\n")
            sandbox.kill()
            assert follow.wait(timeout=30) == 0
        finally:
            follow.kill()
            follow.communicate()
    finally:
        sandbox.kill()
    gone = aenv("logs", sandbox_id)
    assert gone.returncode == 1
    assert gone.stderr.strip() == f"404: sandbox '{sandbox_id}' not found"
    failed = aenv("exec", sandbox_id, "true")
    assert failed.returncode == 1
    assert len(failed.stderr.strip().splitlines()) == 1 and "Traceback" not in failed.stderr


SIZE = r"^(\d+ \d+)$"  # what `stty size` prints: rows and columns


def test_start_opens_a_shell_and_kills_the_sandbox_after_it() -> None:
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    shell = subprocess.Popen(
        [sys.executable, "-m", "aenv.cli", "start", "base"],
        stdin=terminal, stdout=terminal, stderr=terminal, env=env, start_new_session=True,
    )  # fmt: skip
    os.close(terminal)
    seen = Screen(controller)
    try:
        seen.until(r"\$ $")  # the remote shell's prompt
        seen.typed(b"echo hi-$((40+2))\r", r"hi-42")
        assert seen.typed(b"stty size\r", SIZE) == "30 100"
        # A resized terminal resizes the remote one (SIGWINCH), soon: ask until it shows.
        fcntl.ioctl(controller, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        shell.send_signal(signal.SIGWINCH)
        eventually_sync(
            lambda: seen.typed(b"stty size\r", SIZE) == "40 120",
            "the shell took the new size",
            interval=0.5,
        )
        os.write(controller, b"exit\r")
        seen.until_eof()
        assert shell.wait(timeout=60) == 0
    finally:
        shell.terminate()  # on a failure: SIGTERM still kills the sandbox
        try:
            shell.wait(timeout=60)
        except subprocess.TimeoutExpired:
            shell.kill()
            shell.wait()
        os.close(controller)
    match = re.search(r"sandbox (\w+) \(exit the shell", seen.text)
    assert match is not None, seen.text
    assert aenv("info", match.group(1)).returncode == 1  # gone


class Screen:
    """What a program wrote to its terminal, read from the controller side of the pty."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.text = ""

    def _read(self, deadline: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"timed out; the terminal shows:\n{self.text[-3000:]}")
        try:
            data = os.read(self.fd, 4096)
        except OSError:  # EIO: every process holding the terminal has closed it
            return False
        # Colours, cursor movements and carriage returns (rich, the remote prompt, the line
        # discipline) are not the text we look for.
        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", data.decode(errors="replace"))
        self.text += text.replace("\r", "")
        return bool(data)

    def until(self, pattern: str, timeout: float = 120) -> str:
        """The first match of `pattern` in what is written from now on."""
        start, deadline = len(self.text), time.monotonic() + timeout
        while (match := re.search(pattern, self.text[start:], re.MULTILINE)) is None:
            if not self._read(deadline):
                raise AssertionError(f"terminal closed before {pattern!r}:\n{self.text[-3000:]}")
        return match.group(1) if match.groups() else match.group(0)

    def typed(self, keys: bytes, pattern: str) -> str:
        """Type `keys`, then wait for `pattern`."""
        os.write(self.fd, keys)
        return self.until(pattern)

    def until_eof(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self._read(deadline):
            pass
