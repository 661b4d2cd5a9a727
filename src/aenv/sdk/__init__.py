"""This node's extensions of the E2B API (docs/extensions.md), for users of the E2B Python SDK:
functions that call the extension routes with an SDK sandbox's connection settings (or the
SDK's connection options: `api_key`, `api_url`, ...), raising the SDK's own exceptions.

    from e2b import Sandbox
    from aenv.sdk import kill_by_metadata, reset

    sandbox = Sandbox.create("base", metadata={"run": "42"})
    snapshot = sandbox.create_snapshot()
    ...                                     # an episode
    reset(sandbox, snapshot.snapshot_id)    # back to the snapshot: same id, URLs and token
    kill_by_metadata({"run": "42"})         # every sandbox of the run
"""

from aenv.sdk.calls import (
    ForkChild,
    Outcomes,
    delete_snapshots_by_metadata,
    delete_snapshots_by_metadata_async,
    fork_batch,
    fork_batch_async,
    kill_by_metadata,
    kill_by_metadata_async,
    pause_by_metadata,
    pause_by_metadata_async,
    reset,
    reset_async,
    set_timeout_by_metadata,
    set_timeout_by_metadata_async,
)

__all__ = [
    "ForkChild",
    "Outcomes",
    "delete_snapshots_by_metadata",
    "delete_snapshots_by_metadata_async",
    "fork_batch",
    "fork_batch_async",
    "kill_by_metadata",
    "kill_by_metadata_async",
    "pause_by_metadata",
    "pause_by_metadata_async",
    "reset",
    "reset_async",
    "set_timeout_by_metadata",
    "set_timeout_by_metadata_async",
]
