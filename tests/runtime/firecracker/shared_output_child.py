"""Run by `test_firecracker_jailer.py` under `unshare --mount`: a jail on a shared mount (a tmpfs
made shared in this private namespace, as systemd makes `/` shared), entered through
`fake_jailer.py`, gets an output file bound in after it started; the jailed process writes it,
and the bytes must land in the destination on another filesystem without a move. Prints one JSON
line: what the destination holds and whether the jail's side was a mount point.

`python -m tests.runtime.firecracker.shared_output_child WORKDIR`
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from aenv.mounts import mounts_under
from aenv.runtime.firecracker.jailer import Jail, JailerConfig

HERE = Path(__file__).resolve().parent
WRITTEN = "written in the jail"


def main(workdir: Path) -> None:
    base = workdir / "jails"
    base.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(base)], check=True)
    subprocess.run(["mount", "--make-shared", str(base)], check=True)
    jailer = workdir / "jailer"
    jailer.write_text(f'#!/bin/sh\nexec {sys.executable} {HERE / "fake_jailer.py"} "$@"\n')
    jailer.chmod(0o755)
    # Stands in for Firecracker: waits for the go-ahead, then writes its output file.
    exec_file = workdir / "firecracker"
    exec_file.write_text(f"#!/bin/sh\nread line < go\nprintf '{WRITTEN}' > out/memory.bin\n")
    exec_file.chmod(0o755)
    jail = Jail(JailerConfig(binary=jailer, uid=0, gid=0, chroot_base_dir=base), "fc-sh", exec_file)
    jail.create()
    os.mkfifo(jail.host_path("go"))
    process = subprocess.Popen(jail.argv(netns=None, cgroups={}), cwd=jail.root)
    jailed = str(jail.host_path("firecracker"))
    # The jailer stand-in execs the copy once its mount namespace is set up.
    while jailed not in Path(f"/proc/{process.pid}/cmdline").read_bytes().decode(errors="replace"):
        if process.poll() is not None:
            sys.exit("the jailer stand-in exited early")
        time.sleep(0.01)
    destination = workdir / "memory.bin"
    inside = jail.output("out/memory.bin", destination)
    bound = mounts_under(jail.host_path(inside).resolve()) != []
    jail.host_path("go").write_text("go\n")
    process.wait(timeout=30)
    jail.take_out(inside, destination)
    jail.remove({})
    print(json.dumps({"destination": destination.read_text(), "bound": bound}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
