"""This node's extensions of the E2B API, for users of the E2B Python SDK: functions that take
an SDK's `Sandbox` (or `AsyncSandbox`) and call the extension routes with its connection
settings (API URL, key, headers, timeout), raising the SDK's own exceptions.

    from e2b import Sandbox
    from aenv.sdk import reset

    sandbox = Sandbox.create("base")
    snapshot = sandbox.create_snapshot()
    ...                                     # an episode
    reset(sandbox, snapshot.snapshot_id)    # back to the snapshot: same id, URLs and token
"""

from aenv.sdk.calls import reset, reset_async

__all__ = ["reset", "reset_async"]
