"""vmlinux extraction from a bzImage-like blob (compressed ELF after arbitrary setup code)."""

from __future__ import annotations

import gzip
import lzma

import pytest

from aenv.guest.kernel import extract_vmlinux
from aenv.guest.proc import BuildError

ELF = b"\x7fELF" + bytes(range(256)) * 64


@pytest.mark.parametrize(
    "compress", [gzip.compress, lambda d: lzma.compress(d, format=lzma.FORMAT_XZ)]
)
def test_extracts_the_compressed_elf(compress: object) -> None:
    assert callable(compress)
    # A false magic first: the search must go on to the real payload.
    blob = b"setup code \x1f\x8b\x08 not gzip" + compress(ELF) + b"trailing junk"
    assert extract_vmlinux(blob) == ELF


def test_no_kernel_inside() -> None:
    with pytest.raises(BuildError, match="no compressed ELF"):
        extract_vmlinux(b"plain bytes" + gzip.compress(b"not an ELF"))
