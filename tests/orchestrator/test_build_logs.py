"""Template build logs: on disk as they come, capped (head and tail kept, the drop said), read a
page at a time, kept across restarts; records of earlier versions, their log inline, still
load; a command's output is cut into bounded lines."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

from protobuf import Oneof

from aenv.envd.proto.process import process_pb as pb
from aenv.orchestrator.build_logs import ENTRY_OVERHEAD, LEVELS, BuildLog, LogEntry
from aenv.orchestrator.build_records import BuildStatus
from aenv.orchestrator.build_steps import MAX_LINE, StepType, _follow
from tests.doubles.node import double_node
from tests.orchestrator.test_builds import builder, run, spec


def entry(n: int, level: str = "info", ts: float | None = None) -> LogEntry:
    return LogEntry(float(n) if ts is None else ts, level, f"{n:08d}")  # 8 bytes each


def test_a_capped_log_keeps_its_head_and_tail_and_says_what_it_dropped(tmp_path: Path) -> None:
    cost = 8 + ENTRY_OVERHEAD
    log = BuildLog(tmp_path / "b.log.db", 100 * cost)  # 50 entries a half
    log.extend(entry(n) for n in range(1000))
    log.flush()
    entries = log.page(0, 10_000)
    head, marker, tail = entries[:50], entries[50], entries[51:]
    assert [e.message for e in head] == [f"{n:08d}" for n in range(50)]
    assert [e.message for e in tail] == [f"{n:08d}" for n in range(1000 - len(tail), 1000)]
    assert 37 <= len(tail) <= 50  # dropped a quarter of the tail's share at a time
    dropped = 1000 - 50 - len(tail)
    assert marker.level == "warn"
    assert marker.message.startswith(f"[{dropped} lines ({dropped * 8} bytes) of this log dropped")
    log.close()
    assert log.page(0, 10_000) == entries
    assert [p.name for p in tmp_path.iterdir()] == ["b.log.db"]  # no WAL files left
    # Opened again (a restart), it goes on where it was.
    again = BuildLog(tmp_path / "b.log.db", 100 * cost)
    assert again.page(0, 10_000) == entries
    again.extend(entry(n) for n in range(1000, 1100))
    again.flush()
    assert again.page(0, 10_000)[-1].message == f"{1099:08d}"
    assert again.page(0, 10_000)[:50] == head
    again.delete()
    assert list(tmp_path.iterdir()) == []


def test_pages_by_position_level_and_time(tmp_path: Path) -> None:
    log = BuildLog(tmp_path / "b.log.db", 1 << 20)
    log.extend(entry(n, LEVELS[n % 4], ts=n / 1000) for n in range(40))
    log.flush()
    assert [e.message for e in log.page(5, 3)] == ["00000005", "00000006", "00000007"]
    errors = log.page(2, 3, "error")
    assert [e.message for e in errors] == ["00000011", "00000015", "00000019"]
    assert log.page(40, 10) == []
    forward = log.around(10, 3, backward=False, level="warn")
    assert [e.message for e in forward] == ["00000010", "00000011", "00000014"]
    backward = log.around(10, 3, backward=True)
    assert [e.message for e in backward] == ["00000009", "00000008", "00000007"]
    assert [e.message for e in log.around(None, 2, backward=True)] == ["00000039", "00000038"]
    log.close()
    assert [e.message for e in log.page(38, 5)] == ["00000038", "00000039"]  # read closed


async def test_a_log_flood_is_capped_on_disk_and_never_held_in_memory(tmp_path: Path) -> None:
    """50,000 lines of output: the build holds a bounded part of them at a time, its record
    holds none, its log file holds the cap's worth."""
    async with double_node(tmp_path, build_log_max_mb=1) as node:
        builds = builder(node)
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            build = await run(builds, "flood", spec((StepType.RUN, ("seq 50000",))))
            after, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert build.status is BuildStatus.READY, build.reason
        assert peak - before < 8 << 20, f"peak {(peak - before) >> 20} MiB"
        assert after - before < 2 << 20, f"kept {(after - before) >> 20} MiB"
        record = node.config.paths.builds / f"{build.build_id}.json"
        assert record.stat().st_size < 4096
        log_file = node.config.paths.builds / f"{build.build_id}.log.db"
        assert log_file.stat().st_size < 3 << 20
        entries = build.logs.page(0, 1 << 20)
        messages = [e.message for e in entries]
        assert messages[messages.index("1") : messages.index("1") + 3] == ["1", "2", "3"]
        marker = next(m for m in messages if "of this log dropped" in m)
        assert marker.startswith("[") and "build_log_max_mb" in marker
        assert "50000" in messages[-5:] and "ready" in messages[-1]
        assert sum(len(m) + ENTRY_OVERHEAD for m in messages) <= 1 << 20


async def test_an_old_record_with_its_log_inline_still_loads(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        records = node.config.paths.builds
        records.mkdir(parents=True, exist_ok=True)
        old = {
            "template_id": "tpl1", "build_id": "b1", "name": "old", "tags": ["latest"],
            "created_at": 1.0, "status": "error", "cpu_count": None, "memory_mb": None,
            "logs": [
                {"timestamp": 1.0, "level": "info", "message": "[1/1] RUN x", "step": "1"},
                {"timestamp": 2.0, "level": "error", "message": "Build failed", "step": None},
            ],
            "reason": {"message": "RUN 'x' exited with code 1", "step": "1"},
        }  # fmt: skip
        (records / "b1.json").write_text(json.dumps(old))
        loaded = builder(node).get("tpl1", "b1")
        assert loaded is not None and loaded.status is BuildStatus.ERROR
        assert str(loaded.reason) == "RUN 'x' exited with code 1"
        assert loaded.logs.page(0, 10) == [
            LogEntry(1.0, "info", "[1/1] RUN x", "1"),
            LogEntry(2.0, "error", "Build failed", None),
        ]
        assert "logs" not in json.loads((records / "b1.json").read_text())
        again = builder(node).get("tpl1", "b1")  # as after the next restart
        assert again is not None and again.logs.page(0, 10) == loaded.logs.page(0, 10)


async def test_output_without_newlines_is_cut_into_lines() -> None:
    """A command printing no newline would have its output held whole until it ends."""

    async def stream() -> AsyncIterator[pb.StartResponse]:
        for _ in range(5):
            data = pb.ProcessEvent.DataEvent(output=Oneof("stdout", b"x" * 50_000))
            yield pb.StartResponse(event=pb.ProcessEvent(event=Oneof("data", data)))
        end = pb.ProcessEvent.EndEvent(exit_code=0, exited=True)
        yield pb.StartResponse(event=pb.ProcessEvent(event=Oneof("end", end)))

    lines: list[str] = []
    assert await _follow(stream(), lines.append) == 0
    assert [len(line) for line in lines] == [MAX_LINE, MAX_LINE, MAX_LINE, 250_000 - 3 * MAX_LINE]
