"""Placement: cache-affine first, least loaded of a random sample, every node as a fallback."""

from __future__ import annotations

import random

from aenv.cluster.placement import candidates, load
from aenv.cluster.registry import Capacity, NodeReport


def node(name: str, running: int, free_mb: int = 4096, cpus: int = 4) -> NodeReport:
    capacity = Capacity(
        cpus=cpus, memory_mb=8192, memory_free_mb=free_mb, running=running, paused=0
    )
    return NodeReport(name, f"{name}:3000", capacity)


def test_load_counts_sandboxes_per_cpu_and_memory_in_use() -> None:
    assert load(node("a", 0)) == 0.5
    assert load(node("a", 4)) == 1.5
    assert load(node("a", 0, free_mb=0)) == 1.0
    assert load(node("a", 2)) > load(node("b", 2, cpus=8))


def test_no_nodes_no_candidates() -> None:
    assert candidates([], set()) == []


def test_a_holder_comes_first_even_when_busier() -> None:
    nodes = [node("a", 0), node("b", 3), node("c", 1)]
    for seed in range(20):
        order = candidates(nodes, {"b"}, rng=random.Random(seed))
        assert [n.node_id for n in order] == ["b", "a", "c"]


def test_the_least_loaded_of_the_sample_wins() -> None:
    nodes = [node("a", 4), node("b", 0)]
    # A sample as large as the cluster always sees the idle node.
    assert candidates(nodes, set(), sample=2)[0].node_id == "b"


def test_sampling_spreads_creates_over_equally_loaded_nodes() -> None:
    nodes = [node(name, 1) for name in "abcdefgh"]
    rng = random.Random(7)
    firsts = {candidates(nodes, set(), rng=rng)[0].node_id for _ in range(200)}
    assert len(firsts) >= 6


def test_every_node_is_a_fallback_holders_first_then_by_load() -> None:
    nodes = [node("a", 5), node("b", 0), node("c", 2), node("d", 1)]
    order = candidates(nodes, {"c", "a"}, sample=1, rng=random.Random(1))
    assert sorted(n.node_id for n in order) == ["a", "b", "c", "d"]
    rest = [n.node_id for n in order[1:]]
    holders_left = [n for n in rest if n in {"a", "c"}]
    assert rest[: len(holders_left)] == holders_left
