"""A template whose first build has not finished cannot start sandboxes yet: creating one
answers E2B's 404 "has no ready build" naming the build, at once, rather than hanging or
claiming the template does not exist."""

from __future__ import annotations

from tests.api.conftest import Node


async def test_create_before_the_first_build_is_ready(node: Node) -> None:
    requested = await node.client.post("/v3/templates", json={"name": "later"})
    assert requested.status_code == 202
    build_id = requested.json()["buildID"]
    for ref in ("later", requested.json()["templateID"], "later:latest"):
        response = await node.client.post("/sandboxes", json={"templateID": ref})
        assert response.status_code == 404
        body = response.json()
        assert body["code"] == 404
        assert "has no ready build" in body["message"] and build_id in body["message"]
    unknown = await node.client.post("/sandboxes", json={"templateID": "never-built"})
    assert unknown.json() == {"code": 404, "message": "template 'never-built' not found"}
