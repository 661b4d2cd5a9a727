"""The envd bundle: envd, a Python interpreter, its libraries and glibc in one directory that runs
in any Linux guest, whatever its libc (Debian, Ubuntu, Alpine/musl, busybox-only) or lack of Python.

The guest mounts the bundle read-only at `/opt/aenv` and starts `/opt/aenv/aenv-envd`
(see `aenv.guest.init_script`). `python -m aenv.envd_bundle` (`make envd-bundle`) builds it into
`build/envd/`; `build.py` says how and why this layout was chosen over a staticx executable.
"""

from aenv.envd_bundle.build import PREFIX, build_bundle

__all__ = ["PREFIX", "build_bundle"]
