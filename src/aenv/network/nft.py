"""Applying nftables batches: one `nft -j -f -` process per batch, atomic in the kernel.

The process runs in the calling thread's network namespace (a child inherits the namespace of the
thread that forks it), so callers pick the namespace with `netns.run_in`. The JSON CLI is used
rather than libnftables' Python binding because that binding is packaged for Debian's Python, not
for the project's virtualenv. A batch costs one short process (a few ms), paid when a slot is
created or its egress policy changes, never on acquire, egress on/off or teardown.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

Command = dict[str, Any]


class NftError(RuntimeError):
    """nft rejected a batch; nothing of it was applied."""


def apply(commands: list[Command]) -> None:
    proc = subprocess.run(
        ["nft", "-j", "-f", "-"],
        input=json.dumps({"nftables": commands}),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise NftError(f"nft failed ({proc.returncode}): {proc.stderr.strip()}")
