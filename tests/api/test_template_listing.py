"""`GET /templates` lists a template from its first build on, with the newest build's state:
one waiting, building or failed is not invisible until it is ready (`aenv template ls` and
E2B's dashboard read this list), and a ready template shows a failed rebuild."""

from __future__ import annotations

from typing import Any

from tests.api.conftest import BuildNode


def _listed(templates: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(t for t in templates if name in t["aliases"])


async def test_a_first_build_is_listed_while_waiting_and_once_failed(
    build_node: BuildNode,
) -> None:
    client, builder = build_node.client, build_node.builder
    requested = (await client.post("/v3/templates", json={"name": "later"})).json()
    waiting = _listed((await client.get("/templates")).json(), "later")
    assert waiting["buildStatus"] == "waiting"
    assert (waiting["templateID"], waiting["buildID"]) == (
        requested["templateID"],
        requested["buildID"],
    )
    builder.abandon(builder.reserve("other"), "the registry did not answer")
    listed = (await client.get("/templates")).json()
    assert _listed(listed, "other")["buildStatus"] == "error"
    assert _listed(listed, "later")["buildStatus"] == "waiting"
    base = _listed(listed, "base")
    assert base["buildStatus"] == "ready"


async def test_a_ready_template_shows_its_newest_build(
    build_node: BuildNode,
) -> None:
    client, builder = build_node.client, build_node.builder
    builder.abandon(builder.reserve("base"), "rebuild stopped")
    base = _listed((await client.get("/templates")).json(), "base")
    assert base["buildStatus"] == "error"
    # Its files are still the last ready build's: sandboxes start from it as before.
    assert base["buildID"] != builder.latest()[base["templateID"]].build_id
    created = await client.post("/sandboxes", json={"templateID": "base"})
    assert created.status_code == 201
