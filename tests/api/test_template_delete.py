"""Deleting a template while a build of it is under way, as E2B does: the build is cancelled
and the template goes, whether it is the template's first build (listed, no template yet) or
a rebuild of a ready one (which would otherwise make it again when it ends)."""

from __future__ import annotations

from aenv.orchestrator.build_records import BuildStatus
from tests.api.conftest import BuildNode, build, request


async def _names(node: BuildNode) -> set[str]:
    listed = (await node.client.get("/templates")).json()
    return {name for t in listed for name in t["names"]}


async def test_a_template_whose_first_build_waits_is_deleted(build_node: BuildNode) -> None:
    template_id, build_id = await request(build_node, "first")
    assert "first" in await _names(build_node)
    waiting = build_node.builder.get("first", build_id)
    assert waiting is not None and waiting.status is BuildStatus.WAITING
    assert (await build_node.client.delete("/templates/first")).status_code == 204
    assert waiting.status is BuildStatus.ERROR and "cancelled" in str(waiting.reason)
    assert "first" not in await _names(build_node)
    assert build_node.builder.builds_of(template_id) == []
    again = await build_node.client.delete(f"/templates/{template_id}")
    assert again.status_code == 404 and again.json()["code"] == 404


async def test_a_rebuild_under_way_is_cancelled_with_its_template(build_node: BuildNode) -> None:
    ids = await request(build_node, "rebuilt")
    assert (await build(build_node, ids, []))["status"] == "ready"
    held = build_node.builder.orc.node.driver.hold("restore")  # type: ignore[attr-defined]
    template_id, build_id = await request(build_node, "rebuilt")
    started = await build_node.client.post(
        f"/v2/templates/{template_id}/builds/{build_id}",
        json={"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["true"]}]},
    )
    assert started.status_code == 202, started.text
    await held.reached.wait()
    rebuild = build_node.builder.get("rebuilt", build_id)
    assert rebuild is not None and rebuild.status is BuildStatus.BUILDING
    assert (await build_node.client.delete("/templates/rebuilt")).status_code == 204
    held.gate.set()
    assert rebuild.status is BuildStatus.ERROR and "cancelled" in str(rebuild.reason)
    assert build_node.builder.builds_of(template_id) == []
    assert "rebuilt" not in await _names(build_node)
    created = await build_node.client.post("/sandboxes", json={"templateID": "rebuilt"})
    assert created.status_code == 404
