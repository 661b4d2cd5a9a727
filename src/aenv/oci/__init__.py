"""OCI images -> guest root filesystems: a registry v2 client with a shared blob cache
(registry.py, blobs.py, pull.py), layer unpacking (unpack.py), the guest's additions to an
image (inject.py) and the read-only ext4 a template boots from (image_rootfs.py).

The stable entry point for template builds:

    async def rootfs_from_image(
        ref: str,                               # "alpine:3.20", "127.0.0.1:5000/app@sha256:..."
        dest: Path,                             # the ext4 file to write (atomically)
        *,
        cache: Path,                            # $AENV_HOME/cache/oci (blobs under blobs/sha256/)
        credentials: Credentials | None = None, # registry user/password (Basic, or for a token)
        progress: ProgressCallback | None = None,  # called with PullProgress per layer chunk
        platform: Platform | None = None,       # default linux/amd64
    ) -> ImageRootfs                            # .image .reference .digest .platform .config

`ImageRootfs.config` is an `ImageConfig` (env, working_dir, user, entrypoint, cmd) for a build's
ENV/WORKDIR/USER defaults. Every deliberate error is an `ImageError`: `ReferenceError` (bad
ref), `NotFoundError`, `AuthError`, `PlatformNotFoundError` (all `RegistryError`),
`DigestMismatchError`, `UnsafeLayerError`. Transport failures surface as `httpx.HTTPError`.
`pull(ref, cache, ...)` alone fills the blob cache and returns a `PulledImage`.
"""

from aenv.oci.blobs import DigestMismatchError
from aenv.oci.errors import ImageError
from aenv.oci.image_rootfs import ImageConfig, ImageRootfs, rootfs_from_image
from aenv.oci.pull import (
    Layer,
    Platform,
    PlatformNotFoundError,
    ProgressCallback,
    PulledImage,
    PullProgress,
    pull,
)
from aenv.oci.reference import ReferenceError
from aenv.oci.registry import AuthError, Credentials, NotFoundError, RegistryError
from aenv.oci.unpack import UnsafeLayerError

__all__ = [
    "AuthError",
    "Credentials",
    "DigestMismatchError",
    "ImageConfig",
    "ImageError",
    "ImageRootfs",
    "Layer",
    "NotFoundError",
    "Platform",
    "PlatformNotFoundError",
    "ProgressCallback",
    "PullProgress",
    "PulledImage",
    "ReferenceError",
    "RegistryError",
    "UnsafeLayerError",
    "pull",
    "rootfs_from_image",
]
