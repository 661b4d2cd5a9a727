"""The KSM gauges of `/metrics`, read from a directory laid out as /sys/kernel/mm/ksm; no cold
reclaim figures from a node that does not run it."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from aenv.api.metrics import MemorySaversCollector
from aenv.orchestrator.memory_savers import MemorySavers
from aenv.runtime.ksm import Ksm


def scrape(root: Path) -> str:
    registry = CollectorRegistry()
    registry.register(MemorySaversCollector(MemorySavers(Ksm(root))))
    return generate_latest(registry).decode()


def test_ksm_gauges(tmp_path: Path) -> None:
    for name, value in {"run": 1, "pages_shared": 3, "pages_sharing": 10, "full_scans": 2,
                        "ksm_zero_pages": 6}.items():  # fmt: skip
        (tmp_path / name).write_text(f"{value}\n")
    text = scrape(tmp_path)
    assert "aenv_ksm_running 1.0" in text
    assert "aenv_ksm_pages_sharing 10.0" in text
    assert f"aenv_ksm_saved_bytes {16 * 4096}.0" in text


def test_no_ksm_no_gauges(tmp_path: Path) -> None:
    text = scrape(tmp_path / "absent")
    assert "aenv_ksm" not in text and "aenv_cold_reclaim" not in text
