"""The paths of this node's extensions of the E2B API, under `/aenv/` (a prefix E2B's API does
not use): reset in place (`api/reset.py`), the bulk operations (`api/bulk.py`), the batch
fork (`api/snapshots.py`) and the queue of creates waiting for capacity (`api/queue.py`), with
the header a create or fork asks to wait by.

They have a module of their own so that the clients of those routes (the `aenv` CLI,
`aenv.sdk`) name them without importing the routes, which bring in the orchestrator."""

from __future__ import annotations

RESET = "/aenv/sandboxes/{sandbox_id}/reset"
BATCH_FORK = "/aenv/sandboxes/{sandbox_id}/fork"
BULK_SANDBOXES = "/aenv/bulk/sandboxes"  # `/kill`, `/pause`, `/timeout`
BULK_SNAPSHOTS = "/aenv/bulk/snapshots"
QUEUE = "/aenv/queue"
# The operator's routes (`api/admin.py`): E2B's `/admin/...` and this node's teams, which the
# admin token opens, not an API key.
ADMIN_PREFIXES = ("/admin/", "/aenv/admin/")
ADMIN_TEAMS = "/aenv/admin/teams"
ADMIN_HEADER = "X-Admin-Token"
# Seconds a create or fork may wait for capacity instead of answering 429 at once.
WAIT_HEADER = "X-Aenv-Wait"
