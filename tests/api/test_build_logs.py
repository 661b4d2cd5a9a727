"""A template build's log through the E2B routes, on a node of doubles: the status route pages
it by `logsOffset`, `limit` and `level` as the SDK follows it (each entry once, the drop marker
included), the logs route by `cursor`, `direction` and `level`; the build's record and log go
with its template."""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.conftest import BuildNode, build, request

# A follower faster than the SDK's (it polls every 0.2 s): past the default rate limit.
FAST = {"key_requests_per_s": 10_000, "key_request_burst": 10_000}


@pytest.mark.parametrize("settings", [{"build_log_max_mb": 1, **FAST}])
async def test_the_status_route_pages_a_capped_log_as_the_sdk_follows_it(
    build_node: BuildNode,
) -> None:
    ids = await request(build_node, "flood")
    status = await build(build_node, ids, [{"type": "RUN", "args": ["seq 40000"]}])
    assert status["status"] == "ready", status
    route = f"/templates/{ids[0]}/builds/{ids[1]}/status"
    followed: list[dict[str, Any]] = []
    while True:  # as `wait_for_build_finish`: the offset grows by what each page held
        page = await build_node.client.get(route, params={"logsOffset": len(followed)})
        assert page.status_code == 200, page.text
        entries = page.json()["logEntries"]
        assert len(entries) <= 100
        if not entries:
            break
        followed += entries
    messages = [e["message"] for e in followed]
    assert len(messages) == len(set(messages))  # each line once
    (marker,) = [e for e in followed if "of this log dropped" in e["message"]]
    assert marker["level"] == "warn"
    assert "1" in messages[: messages.index(marker["message"])]  # the head
    assert "40000" in messages[messages.index(marker["message"]) :]  # the tail
    warned = await build_node.client.get(
        route, params={"logsOffset": 0, "limit": 5, "level": "warn"}
    )
    assert [e["message"] for e in warned.json()["logEntries"]] == [marker["message"]]
    bad = await build_node.client.get(route, params={"level": "loud"})
    assert bad.status_code == 400 and "level" in bad.json()["message"]


async def test_the_logs_route_reads_from_a_cursor_both_ways(build_node: BuildNode) -> None:
    ids = await request(build_node, "app")
    steps = [{"type": "RUN", "args": ["seq 300"]}]
    assert (await build(build_node, ids, steps))["status"] == "ready"
    route = f"/templates/{ids[0]}/builds/{ids[1]}/logs"
    everything = (await build_node.client.get(route, params={"limit": 100})).json()["logs"]
    assert len(everything) == 100 and everything[0]["message"].startswith("Starting")
    newest = (await build_node.client.get(route, params={"direction": "backward"})).json()
    assert "ready" in newest["logs"][0]["message"]
    assert "300" in [e["message"] for e in newest["logs"][:5]]
    found = build_node.builder.get(*ids)
    assert found is not None
    last_ms = int(found.logs.around(None, 1, backward=True)[0].timestamp * 1000)

    async def page(cursor: int, direction: str) -> list[str]:
        params: dict[str, str | int] = {"cursor": cursor, "direction": direction, "limit": 1}
        answer = await build_node.client.get(route, params=params)
        return [e["message"] for e in answer.json()["logs"]]

    assert await page(0, "forward") == [everything[0]["message"]]
    assert await page(0, "backward") == []
    assert await page(last_ms + 1, "forward") == []
    assert await page(last_ms + 1, "backward") == [newest["logs"][0]["message"]]
    bad = await build_node.client.get(route, params={"direction": "sideways"})
    assert bad.status_code == 400 and "direction" in bad.json()["message"]


async def test_a_builds_record_and_log_go_with_its_template(build_node: BuildNode) -> None:
    ids = await request(build_node, "gone")
    assert (await build(build_node, ids, [{"type": "RUN", "args": ["seq 10"]}]))["status"] == (
        "ready"
    )
    records = build_node.builder.records_dir
    # SQLite's -wal and -shm companions exist while a reader (a status poll) has the log open.
    log = f"{ids[1]}.log.db"
    names = {p.name for p in records.glob(f"{ids[1]}*")}
    assert {f"{ids[1]}.json", log} <= names <= {f"{ids[1]}.json", log, f"{log}-wal", f"{log}-shm"}
    assert (await build_node.client.delete(f"/templates/{ids[0]}")).status_code == 204
    assert list(records.glob(f"{ids[1]}*")) == []
    status = await build_node.client.get(f"/templates/{ids[0]}/builds/{ids[1]}/status")
    assert status.status_code == 404
