"""What a saved state holds (`SaveMode`) and what a stored template is for (`TemplateKind`)."""

from __future__ import annotations

import enum


class SaveMode(enum.StrEnum):
    """What a pause or snapshot saves, and so how it comes back."""

    # Memory, devices and disks: the guest resumes where it was.
    FULL = "full"
    # The disks alone (after the guest wrote its dirty pages back): the guest cold-boots.
    FILESYSTEM = "filesystem"

    @classmethod
    def of(cls, memory: bool) -> SaveMode:
        """The mode the HTTP API's `memory` flag asks for."""
        return cls.FULL if memory else cls.FILESYSTEM

    @property
    def memory(self) -> bool:
        return self is SaveMode.FULL


class TemplateKind(enum.StrEnum):
    """What a stored template is; every kind restores like a template."""

    # A built template users start sandboxes from.
    TEMPLATE = "template"
    # A user's named snapshot of a sandbox (E2B keeps snapshots as templates).
    SNAPSHOT = "snapshot"
    # The checkpoint the children of one fork share; never listed, removed with its last child.
    FORK = "fork"
    # A template build's state after one RUN or COPY step, reused by a later build (hidden).
    BUILD_LAYER = "build-layer"
    # An OCI image's root filesystem cold-booted once, which image builds start from (hidden).
    IMAGE_BASE = "image-base"
