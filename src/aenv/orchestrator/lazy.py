"""Checkpoints a node resumes before it holds their files: the files a guest reads sparsely
(memory, read-only drives) served as it reads them (`storage.lazytree`), kept beside the
sandbox's VM while it runs and ended with it.

One decision says when a pull is lazy (`Archive.pull_lazily`): on a cluster node with
`lazy_pulls` on that can mount FUSE, a resume of a paused sandbox whose checkpoint it has no
local copy of, and a start from a template or snapshot whose files it lacks. A node without
FUSE pulls whole first.

A sandbox's own checkpoint is served for that sandbox alone (`hold`): its serving ends with its
VM. A template's files are shared by every sandbox started from them, whose VMs outlive any one
of them: `SavedStates` owns that serving until the node closes (once whole, its FUSE servers
only answer VMs that mapped the files while they were served), and each sandbox started from it
meanwhile is tied to it (`share`) only so that its saves wait until the files are local.

While served, a save of the VM waits until its files are whole: a pause or snapshot names the
memory file as its base, which must then be an ordinary local file. The chunks the guest
needed, in the order it needed them, are kept at the VM's end for the next upload of the
sandbox's checkpoint (`prefetch_order`): the next lazy resume fetches those first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aenv.config import Config
from aenv.orchestrator.archive import Archive
from aenv.orchestrator.errors import OperationFailed
from aenv.runtime.driver import VM, DriverError
from aenv.storage import lazytree
from aenv.storage.lazytree import LazyTree

log = logging.getLogger("aenv.orchestrator")


def pulls_lazily(config: Config, archive: Archive | None) -> bool:
    """Whether a resume pulls a checkpoint lazily (see the module docstring): a cluster
    node's (its copies carry their images), `lazy_pulls` on, FUSE at hand."""
    return config.lazy_pulls and archive is not None and archive.portable and lazytree.available()


class LazyCheckpoints:
    def __init__(self) -> None:
        self._trees: dict[str, LazyTree] = {}
        self._shared: dict[str, LazyTree] = {}  # a template's serving, by sandbox started from it
        self._orders: dict[str, dict[str, list[int]]] = {}
        self._closing: dict[str, asyncio.Future[None]] = {}

    def hold(self, sandbox_id: str, tree: LazyTree) -> None:
        """`tree` serves the checkpoint `sandbox_id` is being restored from."""
        self._trees[sandbox_id] = tree

    def share(self, sandbox_id: str, tree: LazyTree) -> None:
        """`sandbox_id` starts from a template's files `tree` serves (owned elsewhere): its
        saves wait until they are whole (`whole`)."""
        self._shared[sandbox_id] = tree

    def serving(self, sandbox_id: str) -> LazyTree | None:
        return self._trees.get(sandbox_id)

    async def beside(self, sandbox_id: str, vm: VM) -> None:
        """Keep the sandbox's served files while `vm` runs (a task of its own): a failure to
        fetch them stops the VM (its sandbox then ends as any whose VMM exits, the reason in
        the log), and its exit ends the serving."""
        tree = self._trees.get(sandbox_id)
        if tree is None:
            return

        failure = asyncio.Event()

        def failed(error: BaseException) -> None:
            log.error(
                "sandbox %s: its checkpoint's files could not be fetched (%s); stopping its VM",
                sandbox_id,
                error,
            )
            failure.set()

        tree.on_failure = failed
        if tree.error is not None:
            failed(tree.error)
        exited = asyncio.ensure_future(vm.wait_exit())
        stopping = asyncio.ensure_future(failure.wait())
        try:
            await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if failure.is_set() and not exited.done():
                with contextlib.suppress(DriverError):
                    await vm.stop()
        finally:
            exited.cancel()
            stopping.cancel()
        if self._trees.get(sandbox_id) is tree:
            await self.end(sandbox_id)

    async def whole(self, sandbox_id: str) -> None:
        """Until the sandbox's served files are local (at once when none are served); raises
        `OperationFailed` when they cannot be had."""
        trees = [t for t in (self._trees.get(sandbox_id), self._shared.get(sandbox_id)) if t]
        try:
            for tree in trees:
                await tree.wait_whole()
        except Exception as error:
            raise OperationFailed(
                f"sandbox {sandbox_id}: its checkpoint's files could not be fetched: {error}"
            ) from error

    async def end(self, sandbox_id: str) -> None:
        """Stop serving the sandbox's files (its VM is gone, or never started); returns once
        they are unmounted, also when another caller began it."""
        tree = self._trees.pop(sandbox_id, None)
        if tree is not None:
            self._orders[sandbox_id] = tree.touched
            log.info(
                "sandbox %s: reads needed %d chunks of its checkpoint and waited for %d, %s",
                sandbox_id,
                sum(len(chunks) for chunks in tree.touched.values()),
                tree.waited,
                "the rest in the background" if tree.whole else "its copy not whole",
            )
            started = asyncio.ensure_future(tree.close())
            self._closing[sandbox_id] = started
            started.add_done_callback(lambda _: self._closing.pop(sandbox_id, None))
        closing = self._closing.get(sandbox_id)
        if closing is not None:
            await asyncio.shield(closing)

    async def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: its serving ends, its order is not needed."""
        await self.end(sandbox_id)
        self._orders.pop(sandbox_id, None)
        self._shared.pop(sandbox_id, None)

    def prefetch_order(self, sandbox_id: str) -> dict[str, list[int]] | None:
        """The chunks the sandbox's last lazily restored VM needed, by file, first taken."""
        return self._orders.pop(sandbox_id, None)
