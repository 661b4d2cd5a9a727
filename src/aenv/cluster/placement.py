"""Where a new sandbox goes: cache-affine and load-aware, by power-of-K sampling.

Nodes that already hold the template's files are preferred (no copy before the first boot); among
them, or among all live nodes when none holds it, K are sampled at random and the least loaded
wins, so gateways spread creates without a global scan and without all picking the same
"best" node from the same stale reports. The rest follow as fallbacks, best first, for when a
node refuses (full, failing): holders before others, less loaded before more.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence

from aenv.cluster.registry import NodeReport

SAMPLE = 2


def load(report: NodeReport) -> float:
    """How busy a node is, from its last report: running sandboxes per CPU, plus the share of
    its memory in use (both about 0..1 on a node at its comfortable limit)."""
    capacity = report.capacity
    used = 1 - capacity.memory_free_mb / capacity.memory_mb if capacity.memory_mb else 1.0
    return capacity.running / max(capacity.cpus, 1) + used


def candidates(
    nodes: Sequence[NodeReport],
    holders: Collection[str],
    sample: int = SAMPLE,
    rng: random.Random | None = None,
) -> list[NodeReport]:
    """Every node in `nodes`, in the order to try them for one create (see the module
    docstring); `holders` are the ids of nodes holding the template's files."""
    if not nodes:
        return []
    rng = rng or random.Random()  # noqa: S311 - spreading load, not a secret
    preferred = [n for n in nodes if n.node_id in holders] or list(nodes)
    first = min(rng.sample(preferred, min(sample, len(preferred))), key=load)
    rest = [n for n in nodes if n.node_id != first.node_id]
    rest.sort(key=lambda n: (n.node_id not in holders, load(n)))
    return [first, *rest]
