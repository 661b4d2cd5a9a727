"""Sandbox -> node routing against a real redis-server."""

from __future__ import annotations

import redis.asyncio as aioredis

from aenv.cluster.routing import Routes


async def test_set_lookup_clear(client: aioredis.Redis) -> None:
    routes = Routes(client)
    assert await routes.lookup("sbx1") is None
    await routes.assign("sbx1", "n1")
    await routes.assign("sbx2", "n1")
    assert await routes.lookup("sbx1") == "n1"
    assert await routes.of_node("n1") == {"sbx1", "sbx2"}
    assert await routes.clear("sbx1", "n1")
    assert await routes.lookup("sbx1") is None
    assert await routes.of_node("n1") == {"sbx2"}


async def test_a_moved_route_belongs_to_its_new_node(client: aioredis.Redis) -> None:
    routes = Routes(client)
    await routes.assign("sbx1", "n1")
    await routes.assign("sbx1", "n2")  # resumed on another node
    assert await routes.lookup("sbx1") == "n2"
    assert await routes.of_node("n1") == set()
    # The old node's late kill of its stale copy does not unroute the live one.
    assert not await routes.clear("sbx1", "n1")
    assert await routes.lookup("sbx1") == "n2"


async def test_replace_makes_a_nodes_routes_exact(client: aioredis.Redis) -> None:
    routes = Routes(client)
    await routes.assign("old", "n1")
    await routes.assign("kept", "n1")
    await routes.assign("other", "n2")
    await routes.replace("n1", ["kept", "new"])
    assert await routes.of_node("n1") == {"kept", "new"}
    assert await routes.lookup("old") is None
    assert await routes.lookup("new") == "n1"
    assert await routes.lookup("other") == "n2"
    await routes.replace("n1", [])
    assert await routes.of_node("n1") == set()
    assert await routes.lookup("kept") is None


async def test_a_lost_route_goes_only_while_its_node_has_no_lease(client: aioredis.Redis) -> None:
    routes = Routes(client)
    await routes.assign("sb1", "n1")
    await client.set(routes.keys.lease("n1"), "token")
    assert not await routes.clear_lost("sb1", "n1")
    await client.delete(routes.keys.lease("n1"))
    await routes.assign("sb2", "n2")  # moved since the caller looked: not n1's to drop
    assert not await routes.clear_lost("sb2", "n1")
    assert await routes.clear_lost("sb1", "n1")
    assert await routes.lookup("sb1") is None and await routes.lookup("sb2") == "n2"
    assert await routes.of_node("n1") == set()
