"""Prometheus `/metrics` for the node: sandboxes by state, create queue and outcomes, create
latency as clients see it (queueing included), admission refusals by reason, warm network
slots, the slots' egress proxies' connections by outcome, webhook deliveries by state, warm
pools of VMs, the snapshot repository's reads by source (own cache, peers, store), the host's
KSM sharing, and the node's cold-memory reclaim."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from aenv.orchestrator.admission import Refusal
from aenv.orchestrator.archive import Archive
from aenv.orchestrator.lifecycle import Orchestrator
from aenv.orchestrator.memory_savers import MemorySavers
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.warm import WarmPools

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _NodeCollector(Collector):
    def __init__(self, orchestrator: Orchestrator) -> None:
        self._orc = orchestrator

    def collect(self) -> Iterator[Metric]:
        by_state = GaugeMetricFamily("aenv_sandboxes", "Sandboxes by state", labels=["state"])
        counts = {state: 0 for state in SandboxState}
        for record in self._orc.catalog.list():
            counts[record.state] += 1
        for state, count in counts.items():
            by_state.add_metric([state.value], count)
        yield by_state
        stats = self._orc.stats
        yield GaugeMetricFamily(
            "aenv_create_queue", "Creates waiting for admission", value=stats.queued
        )
        outcomes = CounterMetricFamily("aenv_creates", "Finished creates", labels=["result"])
        outcomes.add_metric(["success"], stats.succeeded)
        outcomes.add_metric(["failure"], stats.failed)
        yield outcomes
        refused = CounterMetricFamily(
            "aenv_create_refusals", "Creates refused at admission", labels=["reason"]
        )
        for reason in Refusal:
            refused.add_metric([reason.value], stats.refused[reason])
        yield refused
        waiting = self._orc.waiting
        yield GaugeMetricFamily(
            "aenv_create_waiting",
            "Creates and fork children waiting for capacity (their clients asked to)",
            value=len(waiting),
        )
        waits = CounterMetricFamily(
            "aenv_create_waits", "Finished waits for capacity", labels=["result"]
        )
        waits.add_metric(["admitted"], waiting.stats.admitted)
        waits.add_metric(["expired"], waiting.stats.expired)
        waits.add_metric(["left"], waiting.stats.left)
        yield waits
        slots = self._orc.slots
        yield GaugeMetricFamily(
            "aenv_warm_slots", "Network slots ready in the pool", value=getattr(slots, "ready", 0)
        )
        yield from _pool_metrics(self._orc.pools)
        # A node's slot pool has them; the doubles' slots do not.
        egress_counts = getattr(slots, "egress_counts", None)
        if egress_counts is not None:
            egress = CounterMetricFamily(
                "aenv_egress_connections",
                "Guest connections the slots' egress proxies handled, by outcome",
                labels=["outcome"],
            )
            for outcome in ("relayed", "tunneled", "refused", "failed", "intercepted"):
                egress.add_metric([outcome], getattr(egress_counts, outcome))
            yield egress
        deliveries = GaugeMetricFamily(
            "aenv_webhook_deliveries",
            "Webhook deliveries in the queue and log (kept with their events), by state",
            labels=["state"],
        )
        for delivery_state, count in self._orc.webhooks.store.counts().items():
            deliveries.add_metric([delivery_state.value], count)
        yield deliveries
        archive = self._orc.saved.archive
        if archive is not None:
            yield from _repository_metrics(archive)


def _repository_metrics(archive: Archive) -> Iterator[Metric]:
    """What pulls read, by source: this node's cache, other nodes' (peers), the store."""
    chunks = CounterMetricFamily(
        "aenv_repository_read_chunks", "Chunks pulls read, by source", labels=["source"]
    )
    read = CounterMetricFamily(
        "aenv_repository_read_bytes",
        "Bytes pulls read (compressed, as stored), by source",
        labels=["source"],
    )
    for source, (count, size) in archive.reads().items():
        chunks.add_metric([source], count)
        read.add_metric([source], size)
    yield chunks
    yield read
    stats = archive.stats
    yield CounterMetricFamily(
        "aenv_repository_peer_failures",
        "Peers pulls left out after an error, a timeout or a damaged chunk",
        value=stats.peer_failures,
    )
    yield CounterMetricFamily(
        "aenv_repository_uploaded_bytes",
        "Bytes stored in the repository (compressed), new chunks only",
        value=stats.bytes_uploaded,
    )


def _pool_metrics(pools: WarmPools) -> Iterator[Metric]:
    """Warm pools, per template: VMs ready, and what happened to creates and pooled VMs."""
    sizes = GaugeMetricFamily("aenv_pool_vms", "Pooled VMs ready", labels=["template"])
    for template_id, size in pools.sizes().items():
        sizes.add_metric([template_id], size)
    yield sizes
    counters = pools.counters
    for name, helptext, counts in (
        ("aenv_pool_hits", "Creates served by a pooled VM", counters.hits),
        (
            "aenv_pool_misses",
            "Creates of a pooled template that found its pool empty",
            counters.misses,
        ),
        ("aenv_pool_refills", "VMs restored into a pool", counters.refills),
        ("aenv_pool_evictions", "Pooled VMs given back unused", counters.evictions),
    ):
        family = CounterMetricFamily(name, helptext, labels=["template"])
        for template_id, count in counts.items():
            family.add_metric([template_id], count)
        yield family


class MemorySaversCollector(Collector):
    """The host's KSM (host-wide: the node's guests and anything else mergeable), nothing when
    the kernel has none; the node's DAMON `pageout` scheme, what it tried and paged out since
    the node started it, nothing when it is off."""

    def __init__(self, savers: MemorySavers) -> None:
        self._savers = savers

    def collect(self) -> Iterator[Metric]:
        ksm = self._savers.ksm_stats()
        if ksm is not None:
            yield GaugeMetricFamily("aenv_ksm_running", "KSM is merging", value=int(ksm.running))
            yield GaugeMetricFamily(
                "aenv_ksm_pages_sharing", "Pages mapped onto merged pages", value=ksm.pages_sharing
            )
            yield GaugeMetricFamily(
                "aenv_ksm_saved_bytes", "Memory KSM saves (merged and zero pages)",
                value=ksm.saved_bytes,
            )  # fmt: skip
        reclaim = self._savers.reclaim_stats()
        if reclaim is None:
            return
        yield GaugeMetricFamily(
            "aenv_cold_reclaim_running", "The node's kdamond is running", value=int(reclaim.running)
        )
        yield CounterMetricFamily(
            "aenv_cold_reclaim_tried_bytes", "Bytes of cold regions the scheme was applied to",
            value=reclaim.tried_bytes,
        )  # fmt: skip
        yield CounterMetricFamily(
            "aenv_cold_reclaim_applied_bytes", "Bytes paged out", value=reclaim.applied_bytes
        )
        yield CounterMetricFamily(
            "aenv_cold_reclaim_quota_exceeded", "Times the quota stopped the scheme",
            value=reclaim.quota_exceeded,
        )  # fmt: skip


class NodeMetrics:
    def __init__(self, orchestrator: Orchestrator, savers: MemorySavers | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_NodeCollector(orchestrator))
        self.registry.register(MemorySaversCollector(savers or MemorySavers()))
        self.create_seconds = Histogram(
            "aenv_create_seconds",
            "Sandbox create latency seen by clients, queueing included",
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60),
            registry=self.registry,
        )

    async def endpoint(self, _: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE)
