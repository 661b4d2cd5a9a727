"""Layered memory state for QEMU: a saved VM as its base memory file plus a chain of states,
each holding only the pages changed since the one before (issue 18, the fifth slice).

Why layers: a VM restored from base + delta holds the delta's pages as anonymous pages again,
so `ramdelta` alone saves them again at every save, plus whatever changed since: over 100
pause/resume cycles of an idle sandbox, bytes per pause grew 8.9 → 14.9 MiB. The page map
cannot tell a page loaded at the restore from one the guest wrote later (this kernel has no
soft-dirty bits, and QEMU 7.2's dirty bitmap lives within one migration only). Content can: a
save of a VM restored from a chain (`Snapshot.layers` then `Snapshot.state_file`) also drops
each record whose page holds what the chain held for it (`Parent.same`, one comparison of
4 KiB with the newest layer's record, only for the chain's own pages, a few thousand). The new
state records the chain as its `layers`, so a state is base + L1 + ... + Ln.

Flattening: `QemuDriver.merge_layers` writes a chain composed (below) into one state, a delta
against the base with no layers, without running the guest; the orchestrator does it in the
background for a pause checkpoint once its chain is deep (`detach.Detacher.merge`, adopted
atomically like a detached form), and before the restore when a resume comes first (it stops
the background merge); fork checkpoints are merged before their children restore. The driver
caps chains too, for whatever else lies over a deep chain: a save over `MAX_DEPTH` states keeps
every changed page, a delta against the base again (what a merge would hold).

Why no hash index beside each layer: the layers are small (a few MiB of records), so indexing
them at a save or a restore (`ramdelta.index_stream`, a walk over their records) costs a few
ms and keeps the saved files exactly QEMU streams that load on their own.

A restore feeds QEMU one stream through a pipe (`compose`): the newest state's stream, with the
records of the older layers' pages that it lacks put after its RAM block list (each page once,
from the newest layer holding it), so QEMU loads the chain as it loads one delta; device
sections are the newest state's. A chain that is not understood fails the restore (the pipe
ends short, QEMU refuses it), never restores other memory. A saved state whose stream the
filter did not understand (kept whole) carries every page and is never a layer: it starts no
chain (`chain` leaves states over `MAX_BYTES` out, as they are that or most of the RAM).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aenv.runtime.ramdelta import PAGE, StreamIndex, index_stream, page_record

# States a chain holds at most, the newest included: a restore composes them all.
MAX_DEPTH = 8


@dataclass(frozen=True)
class _Layer:
    path: Path
    data: mmap.mmap
    index: StreamIndex


class Chain:
    """The states a VM was restored from, oldest first, mapped and indexed: what it held for
    each page at its restore is the newest layer's record of that page, or else its base
    file's. Blocking; `close` when done."""

    def __init__(self, paths: Sequence[Path], block: bytes) -> None:
        self.block = block
        self.layers: list[_Layer] = []
        with contextlib.ExitStack() as undo:
            undo.callback(self.close)  # the layers mapped so far
            for path in paths:
                with open(path, "rb") as f:
                    data = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
                self.layers.append(_Layer(path, data, _index(data, block)))
            undo.pop_all()
        # page -> (layer, payload position or -1 - fill byte), the newest layer's record.
        self.where: dict[int, tuple[int, int]] = {}
        for i, layer in enumerate(self.layers):
            self.where.update((page, (i, at)) for page, at in layer.index.pages.items())

    def close(self) -> None:
        for layer in self.layers:
            # A filter thread still comparing (its save failed or was cancelled) holds a view:
            # the map then closes when the thread lets it go.
            with contextlib.suppress(BufferError):
                layer.data.close()

    def holding_pages(self) -> tuple[Path, ...]:
        """The states that carry pages of the block: a state with none (a template's, a
        detached one's device state) adds nothing to the chain, so it is no layer of it."""
        return tuple(layer.path for layer in self.layers if layer.index.pages)

    def same(self, page: int, payload: memoryview, zero: bool) -> bool:
        """`ramdelta.Same`: whether a record's page holds what the chain has for `page`; False
        for pages the chain lacks (the base's: only changed ones are compared)."""
        found = self.where.get(page)
        if found is None:
            return False
        layer, at = found
        held = self.layers[layer].data
        if at < 0:
            theirs: bytes | memoryview = bytes([-1 - at]) * PAGE
        else:
            theirs = memoryview(held)[at : at + PAGE]
        ours = bytes(payload) * PAGE if zero else payload
        try:
            return ours == theirs
        finally:
            if isinstance(theirs, memoryview):
                theirs.release()

    def compose(self, write: Callable[[bytes | memoryview], object]) -> int:
        """The chain as one stream QEMU loads: the newest state with the older layers' pages it
        lacks put after its block list. Returns how many pages came from older layers."""
        top = self.layers[-1]
        older = sorted(
            (page, found) for page, found in self.where.items() if found[0] != len(self.layers) - 1
        )
        view = memoryview(top.data)
        try:
            write(view[: top.index.records_at])
            name: bytes | None = self.block
            for page, (layer, at) in older:
                held = self.layers[layer].data
                payload = bytes([-1 - at]) if at < 0 else held[at : at + PAGE]
                write(page_record(page, payload, name))
                name = None
            write(view[top.index.records_at :])
        finally:
            view.release()
        return len(older)


def _index(data: mmap.mmap, block: bytes) -> StreamIndex:
    view = memoryview(data)
    try:
        return index_stream(view, block)
    finally:
        view.release()


def chain(layers: Sequence[Path], state: Path, guest_bytes: int) -> tuple[Path, ...]:
    """The states a VM restored from `layers` then `state` compares its next save with: all of
    them, unless the chain is as deep as `MAX_DEPTH` or holds more than half the guest's RAM
    (a state kept whole, or a guest that rewrote most of its memory), when its next save is a
    delta against the base (`()`) that starts a new chain. Blocking."""
    states = (*layers, state)
    if len(states) >= MAX_DEPTH:
        return ()
    if sum(os.stat(p).st_size for p in states) > guest_bytes // 2:
        return ()
    return states


def compose_into(paths: Sequence[Path], block: bytes, fd: int) -> int:
    """`Chain.compose` of `paths` into file descriptor `fd` (a pipe QEMU reads: closed by the
    caller). Raises `ramdelta.StreamFormatError` or `OSError`, leaving the stream short (so
    QEMU refuses it). Blocking."""
    layers = Chain(paths, block)
    try:
        with open(fd, "wb", closefd=False) as out:
            return layers.compose(out.write)
    finally:
        layers.close()
