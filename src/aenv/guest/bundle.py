"""The envd bundle drive: a read-only ext4 image our init mounts at `/opt/aenv` in every guest.

It holds `aenv-envd` (self-contained, independent of the guest's libc and Python) and anything it
ships with; one image is shared read-only by every sandbox on a host.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from aenv.guest.cmdline import ENVD_LABEL
from aenv.guest.rootfs import make_ext4

ENTRYPOINT = "aenv-envd"


async def build_envd_drive(bundle: Path, image: Path) -> Path:
    """`bundle` is the envd executable or a directory holding `aenv-envd`; `image` is written."""
    if bundle.is_dir():
        if not (bundle / ENTRYPOINT).is_file():
            raise FileNotFoundError(f"{bundle} has no {ENTRYPOINT}")
        return await make_ext4(bundle, image, label=ENVD_LABEL, read_only=True)
    with tempfile.TemporaryDirectory(prefix="aenv-envd-drive-") as tmp:
        tree = Path(tmp)
        await asyncio.to_thread(shutil.copy2, bundle, tree / ENTRYPOINT)
        (tree / ENTRYPOINT).chmod(0o755)
        return await make_ext4(tree, image, label=ENVD_LABEL, read_only=True)
