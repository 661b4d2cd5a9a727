"""Wheels of the code interpreter server's own requirements (no data stack), for VM tests
whose server namespace has no route to PyPI: downloaded once from here with the host's pip into
build/ (gitignored). The guest's Python is Debian bookworm's 3.11, as the test machines' is.

What a guest takes is `SITE`: the wheels unpacked and compiled here, as one gzipped tar that the
guest's tar unpacks. Unzipping and compiling them in a guest under TCG took 135 s, unpacking the
archive 39 s (a 256 MiB sandbox, the host otherwise idle; the host makes it in ≈ 15 s once).
Bytecode of any 3.11 release loads in any other, and the archive keeps the sources' times,
which the bytecode is checked against."""

from __future__ import annotations

import compileall
import py_compile
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]
WHEELS = PROJECT / "build" / "code-interpreter-wheels"
SITE = PROJECT / "build" / "code-interpreter-site.tar.gz"
# The directory the archive holds, to be unpacked in the guest's /opt/aenv-ci.
SITE_DIR = "site"
SERVER_REQUIREMENTS = ("jupyter_client>=8.6,<9", "ipykernel>=6.29,<8", "starlette>=0.47,<2",
                       "uvicorn>=0.30,<1", "pydantic>=2.7,<3")  # fmt: skip


def ensure_code_interpreter_wheels() -> Path:
    stamp = WHEELS / ".complete"
    if not stamp.exists():
        WHEELS.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
             "--python-version", "3.11", "-d", str(WHEELS), *SERVER_REQUIREMENTS],
            check=True,
            timeout=600,
        )  # fmt: skip
        stamp.touch()
    return WHEELS


def ensure_code_interpreter_site() -> Path:
    """`SITE`, made from the wheels once (and again if they are downloaded again)."""
    wheels = ensure_code_interpreter_wheels()
    if SITE.exists() and SITE.stat().st_mtime >= (wheels / ".complete").stat().st_mtime:
        return SITE
    if sys.version_info[:2] != (3, 11):
        raise RuntimeError("the guest's Python is 3.11: its bytecode must be compiled by a 3.11")
    with tempfile.TemporaryDirectory(dir=SITE.parent) as scratch:
        site = Path(scratch) / SITE_DIR
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
        timestamps = py_compile.PycInvalidationMode.TIMESTAMP
        if not compileall.compile_dir(site, quiet=1, workers=0, invalidation_mode=timestamps):
            raise RuntimeError(f"the code interpreter's wheels did not compile ({site})")
        partial = Path(scratch) / SITE.name
        with tarfile.open(partial, "w:gz", compresslevel=1) as tar:
            tar.add(site, SITE_DIR, filter=_owned_by_root)
        partial.replace(SITE)
    return SITE


def _owned_by_root(member: tarfile.TarInfo) -> tarfile.TarInfo:
    member.uid = member.gid = 0
    member.uname = member.gname = "root"
    return member
