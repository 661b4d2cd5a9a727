"""The snapshot repository's reads by source on `/metrics`, from a node on the doubles whose
repository (a directory, the default) stored and pulled a tree."""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import generate_latest

from aenv.api.metrics import NodeMetrics
from tests.doubles.node import double_node

MiB = 1 << 20


async def test_pulls_are_counted_by_source(tmp_path: Path) -> None:
    async with double_node(tmp_path / "home") as node:
        archive = node.orchestrator.saved.archive
        assert archive is not None
        metrics = NodeMetrics(node.orchestrator)
        src = tmp_path / "src"
        src.mkdir()
        (src / "memory").write_bytes(os.urandom(3 * MiB))
        manifest = await archive.repository.put_tree(src, name="tree")
        await archive.repository.get_tree(manifest.id, tmp_path / "pulled")
        text = generate_latest(metrics.registry).decode()
    # The put cached every chunk: the pull read them all here, none from elsewhere.
    chunks = 'aenv_repository_read_chunks_total{source="%s"}'
    assert [value(text, chunks % s) for s in ("cache", "peer", "store")] == [3, 0, 0]
    cached = archive.stats.bytes_from_cache
    assert cached > 3 * MiB  # random bytes: stored as they are, plus zstd's framing
    assert value(text, 'aenv_repository_read_bytes_total{source="cache"}') == cached
    assert value(text, "aenv_repository_uploaded_bytes_total") == cached
    assert value(text, "aenv_repository_peer_failures_total") == 0


def value(text: str, sample: str) -> float:
    """The value of one sample (its name and labels as exposed) in a scrape."""
    (line,) = [line for line in text.splitlines() if line.startswith(sample + " ")]
    return float(line.rpartition(" ")[2])
