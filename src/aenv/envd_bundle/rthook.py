"""PyInstaller runtime hook of the envd bundle: runs inside the bundle before envd is imported.

PyInstaller's bootloader points LD_LIBRARY_PATH at the bundle (which holds our own glibc) and
re-executes itself. The dynamic loader reads the variable only at process start, so dropping it
here changes nothing for envd, while a child that inherited it would load our glibc and
libraries instead of the guest's own (fatal on a musl guest). The caller's value, if it had one,
was saved by the bootloader as LD_LIBRARY_PATH_ORIG.
"""

import os

_original = os.environ.pop("LD_LIBRARY_PATH_ORIG", None)
if _original is None:
    os.environ.pop("LD_LIBRARY_PATH", None)
else:
    os.environ["LD_LIBRARY_PATH"] = _original
