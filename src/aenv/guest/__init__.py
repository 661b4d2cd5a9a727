"""What makes a guest bootable: kernel, initramfs with our init, root filesystem images.

Built on the host (in threads/subprocesses, cached by input), consumed by `aenv.runtime` drivers.
"""
