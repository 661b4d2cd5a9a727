"""A stand-in for envd inside test guests, shipped on the envd bundle drive.

The guest's init starts `/opt/aenv/aenv-envd --port 49983` exactly as it will start the real envd;
this one answers `GET /` with what the tests compare across snapshots (a value held only in the
process's memory, a file on the root filesystem, random bytes), `GET /zombies`,
`POST /?memory=..&note=..`, `POST /orphan` (leaves an orphan for PID 1 to reap) and
`POST /fill` (writes until the disk is full) and `POST /run` (runs a program in the guest, as
envd's process API does: JSON `{"argv": [...], "timeout": s}` in, `{"rc", "stdout", "stderr"}` out,
`rc` negative when a signal ended the program).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from aenv.guest.bundle import build_envd_drive

AGENT = r"""
import errno, glob, http.server, json, os, subprocess, sys, urllib.parse
PORT = int(sys.argv[sys.argv.index("--port") + 1])
NOTE = "/home/user/note"
state = {"memory": None, "hits": 0}

def zombies():
    count = 0
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                count += f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            pass
    return count

class Handler(http.server.BaseHTTPRequestHandler):
    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/zombies":
            return self._send({"zombies": zombies()})
        state["hits"] += 1
        try:
            with open(NOTE) as f:
                note = f.read()
        except FileNotFoundError:
            note = None
        self._send({"memory": state["memory"], "note": note, "hits": state["hits"],
                    "random": os.urandom(8).hex(), "pid": os.getpid()})

    def do_POST(self):
        if self.path == "/run":
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            try:
                done = subprocess.run(req["argv"], capture_output=True, text=True,
                                      timeout=req.get("timeout", 60))
            except subprocess.TimeoutExpired:
                return self._send({"rc": None, "stdout": "", "stderr": "timeout"})
            return self._send({"rc": done.returncode, "stdout": done.stdout,
                               "stderr": done.stderr})
        if self.path == "/orphan":  # a child whose parent exits at once: PID 1 must reap it
            subprocess.run(["sh", "-c", "sleep 0.2 &"], check=True)
            return self._send({"ok": True})
        if self.path == "/fill":  # write until the disk is full
            written, error = 0, None
            fd = os.open("/home/user/fill", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            block = b"\x5a" * (1 << 20)
            try:
                while True:
                    written += os.write(fd, block)
            except OSError as exc:
                error = errno.errorcode.get(exc.errno, str(exc.errno))
            finally:
                os.close(fd)
            return self._send({"written": written, "error": error})
        q = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
        state["memory"] = q["memory"][0]
        with open(NOTE, "w") as f:
            f.write(q["note"][0])
            f.flush()
            os.fsync(f.fileno())
        self._send({"ok": True})

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("0.0.0.0", PORT), Handler).serve_forever()
"""

LAUNCHER = '#!/bin/sh\nexec python3 /opt/aenv/agent.py "$@"\n'


async def build_agent_bundle(workdir: Path) -> Path:
    """An ext4 drive labelled like the envd bundle, holding the stand-in agent."""
    tree = workdir / "bundle"
    tree.mkdir()
    (tree / "agent.py").write_text(AGENT)
    launcher = tree / "aenv-envd"
    launcher.write_text(LAUNCHER)
    launcher.chmod(0o755)
    image = await build_envd_drive(tree, workdir / "bundle.ext4")
    shutil.rmtree(tree)
    return image
