"""`python bench/cluster.py`: cluster state on Redis, a SIMULATION: 100 node agents that
register, heartbeat and publish like real ones but hold no VMs, 300 sandboxes each (30,000 in
all), one real redis-server on loopback. Prints JSON.

- routing lookup (`Routes.lookup`, what a gateway does per request) p50/p99 over a Redis PING on
  the same client in the same run;
- Redis memory per routed sandbox (used_memory after publishing over before);
- the time to rebuild all routes after a FLUSHALL (every node republishes on its next beat) over
  the time of the first publish;
- a steady heartbeat (renewal, nothing changed) over a PING.

`python bench/cluster.py proxy`: a real node (in a network namespace of its own, real VMs) behind
a real gateway (in another, joined by a veth pair), the SDK in the gateway's namespace:
`commands.run("true")` through the gateway over the same sandbox reached straight at its node,
interleaved in one run (target: at most 1.1x).

`python bench/cluster.py gateway-cpu`: a real `aenv gateway` process in front of two node
doubles (`tests/cluster/node_double.py`: the real internal gate over a catalog, creates without
VMs, so only the gateway's own work is measured) and a real redis-server: the gateway process's
CPU time (user + system, from /proc) per create (`POST /sandboxes`: placement reads, the
forward, the answer), over its CPU time per `GET /health` (one Redis read) in the same run.

`python bench/cluster.py resume`: two real nodes sharing an S3 repository (moto's server) behind
a real gateway, the SDK in the gateway's namespace: one sandbox (with 16 MiB of fresh data
written) resumed on the node it paused on (`Sandbox.connect` + `commands.run("true")`), against
the same resumed on the other node after its own is drained (`aenv node drain`: the release
waits for the upload; the connect moves it and pulls the checkpoint), alternating nodes. Bytes
moved: the apparent size of the sandbox's directory on the node it moved to, after the resume
(the pulled copy, its images included).

`python bench/cluster.py creates`: the same two nodes behind a gateway: creates per second of
batches of concurrent `Sandbox.create` through the gateway with one node drained, against both
nodes, alternating, in one run (CPU-bound under TCG on one machine: both nodes share its cores).

`python bench/cluster.py burst [COUNT]`: three real nodes behind a gateway: COUNT (200 by
default) `Sandbox.create` at once through the gateway with two nodes drained, then with all
three, in one run: creates per second (sandboxes started over the burst's time), and how many
failed, by SDK exception and message (429s included: a node at capacity), then every started
one killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from summary import summary_ms

from aenv.cluster.agent import NodeAgent, NodeState
from aenv.cluster.registry import Capacity, NodeRegistry
from aenv.cluster.routing import Routes
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.store import connect
from aenv.orchestrator.secrets import SecretRecord
from aenv.orchestrator.webhooks import Webhook
from tests.support.redis_server import redis_server

if TYPE_CHECKING:
    from tests.cluster.cluster_ns import Cluster

NODES = 100
SANDBOXES_PER_NODE = 300
SAMPLES = 3000
SECRET = ClusterSecret("bench-cluster-secret-0123456789")


@dataclass
class SimulatedNode:
    """A node's catalog without VMs: ids only, as a real node reports them."""

    sandboxes: set[str]

    async def state(self) -> NodeState:
        capacity = Capacity(64, 262144, 131072, running=len(self.sandboxes), paused=0)
        return NodeState(capacity, self.sandboxes, {"base"}, set())

    async def forget(self, sandbox_id: str) -> None:
        self.sandboxes.discard(sandbox_id)

    async def mirror_webhooks(self, hooks: Sequence[Webhook]) -> None:
        """A simulated node delivers no events."""

    async def mirror_secrets(self, secrets: Sequence[tuple[SecretRecord, str]]) -> None:
        """A simulated node sends no requests out."""

    async def running_by_key(self) -> dict[str, set[str]]:
        # Not simulated: the figures of docs/benchmarks.md were measured without keys' counts.
        return {}

    async def disk_by_team(self) -> dict[str, int]:
        # Nor teams' disk, for the same reason.
        return {}


async def timed(calls: list[Callable[[], Awaitable[object]]], samples: int) -> list[list[float]]:
    """Each call's durations, the calls interleaved so that load on the machine hits all alike."""
    durations: list[list[float]] = [[] for _ in calls]
    for _ in range(samples):
        for call, spent in zip(calls, durations, strict=True):
            start = time.perf_counter()
            await call()
            spent.append(time.perf_counter() - start)
    return durations


async def run(url: str) -> dict[str, Any]:
    client = connect(url)
    nodes = [
        SimulatedNode({f"n{n:03}s{s:03}".ljust(20, "x") for s in range(SANDBOXES_PER_NODE)})
        for n in range(NODES)
    ]
    agents = [
        NodeAgent(client, f"node-{n:03}", f"10.1.{n // 250}.{n % 250}:3000", node, SECRET, 60)
        for n, node in enumerate(nodes)
    ]
    before = (await client.info("memory"))["used_memory"]
    start = time.perf_counter()
    await asyncio.gather(*(agent.beat() for agent in agents))
    publish = time.perf_counter() - start
    after = (await client.info("memory"))["used_memory"]

    routes = Routes(client)
    ids = [s for node in nodes for s in node.sandboxes]

    async def ping() -> None:
        await client.ping()

    lookup, ping_ = await timed([lambda: routes.lookup(random.choice(ids)), ping], SAMPLES)
    heartbeat, ping_h = await timed([agents[0].beat, ping], SAMPLES // 10)

    await client.flushall()
    start = time.perf_counter()
    republished = await asyncio.gather(*(agent.beat() for agent in agents))
    rebuild = time.perf_counter() - start
    assert all(republished)
    sample = random.sample(ids, 500)
    assert all([await routes.lookup(s) for s in sample]), "a route was not rebuilt"
    await client.aclose()
    p = summary_ms
    return {
        "simulation": True,
        "nodes": NODES,
        "sandboxes": len(ids),
        "lookup_ms": p(lookup),
        "ping_ms": p(ping_),
        "lookup_over_ping_p50": round(p(lookup)["median"] / p(ping_)["median"], 2),
        "lookup_over_ping_p99": round(p(lookup)["p99"] / p(ping_)["p99"], 2),
        "redis_bytes_per_sandbox": round((after - before) / len(ids)),
        "first_publish_s": round(publish, 3),
        "rebuild_after_flushall_s": round(rebuild, 3),
        "rebuild_over_first_publish": round(rebuild / publish, 2),
        "steady_heartbeat_ms": p(heartbeat),
        "heartbeat_over_ping_p50": round(p(heartbeat)["median"] / p(ping_h)["median"], 2),
    }


# Runs in the gateway's namespace: one sandbox made through the gateway, reached through it and
# straight at its node (E2B_SANDBOX_URL is the gateway's, argv[1] the node's), timed alternately.
PROXY_CLIENT = """
import json, sys, time
from e2b import Sandbox
node_url, samples = sys.argv[1], int(sys.argv[2])
through = Sandbox.create("base", timeout=600)
direct = Sandbox.connect(through.sandbox_id, sandbox_url=node_url)
for sandbox in (through, direct) * 10:
    sandbox.commands.run("true")
spent = {"gateway": [], "direct": []}
for _ in range(samples):
    for name, sandbox in (("gateway", through), ("direct", direct)):
        start = time.perf_counter()
        sandbox.commands.run("true")
        spent[name].append(time.perf_counter() - start)
through.kill()
print(json.dumps(spent))
"""


@dataclass
class OnCluster:
    """Real nodes behind a started gateway (bench `proxy`, `resume`, `creates`)."""

    nodes: Cluster
    routes: Routes
    env: dict[str, str]  # the SDK pointed at the gateway

    def run(self, *argv: str) -> str:
        """`argv` in the gateway's namespace with `env`: its output; raises when it fails."""
        code, out = self.nodes.gateway.run(list(argv), env=self.env, timeout=1800)
        if code != 0:
            raise RuntimeError(out)
        return out

    def client(self, source: str, *args: str) -> Any:
        """The Python `source` (an SDK client) run with `args` in the gateway's namespace: the
        last line of its output, as JSON."""
        return json.loads(self.run(sys.executable, "-c", source, *args).strip().splitlines()[-1])

    def aenv(self, *args: str) -> None:
        """The `aenv` command in the gateway's namespace (`node drain`, say)."""
        self.run(sys.executable, "-m", "aenv.cli", *args)


def sandbox_bytes(home: Path, sandbox_id: str) -> int:
    """The apparent size of the sandbox's directory on the node whose home is `home` (`du`:
    its sparse files as big as they claim)."""
    from aenv.config import Paths

    directory = Paths(home).sandboxes / sandbox_id
    du = subprocess.run(["du", "-sb", str(directory)], capture_output=True, text=True, check=True)
    return int(du.stdout.split()[0])


@contextlib.asynccontextmanager
async def on_cluster(
    scratch: Path,
    nodes: list[str],
    settings: dict[str, str] | None = None,
    shared_repository: bool = False,
) -> AsyncIterator[OnCluster]:
    """Real nodes `nodes` (homes under `scratch`) on a real Redis, every one registered, and
    their gateway started."""
    from aenv.config import Paths
    from aenv.orchestrator.images import prepare_images
    from tests.cluster.cluster_ns import cluster
    from tests.support.guest import GUEST_CACHE, MIRROR

    for node_id in nodes:
        await prepare_images(Paths(scratch / node_id).cache, GUEST_CACHE, MIRROR)
    (scratch / "redis").mkdir()
    with redis_server(scratch / "redis") as server:
        client = connect(server.url)
        try:
            registry = NodeRegistry(client, SECRET)
            every = {"AENV_REDIS_URL": server.unix_url, "AENV_CLUSTER_SECRET": SECRET.value}
            with cluster(scratch, nodes, every | (settings or {}), shared_repository) as c:
                while len(await registry.live()) < len(nodes):
                    await asyncio.sleep(0.5)
                c.gateway.start()
                c.gateway.wait_ready()
                env = {
                    "E2B_API_URL": c.gateway.url,
                    "E2B_SANDBOX_URL": c.gateway.url,
                    "E2B_API_KEY": c.gateway.api_key,
                }
                yield OnCluster(c, Routes(client), env)
        finally:
            await client.aclose()


async def proxy(scratch: Path, samples: int = 200) -> dict[str, Any]:
    async with on_cluster(scratch, ["node-a"]) as on:
        node_url = f"http://{on.nodes.addresses['node-a']}"
        spent = on.client(PROXY_CLIENT, node_url, str(samples))
    through, direct = summary_ms(spent["gateway"]), summary_ms(spent["direct"])
    return {
        "commands_run_true_through_gateway_ms": through,
        "commands_run_true_straight_to_node_ms": direct,
        "gateway_over_direct_p50": round(through["median"] / direct["median"], 3),
        "gateway_over_direct_p99": round(through["p99"] / direct["p99"], 3),
    }


# Runs in the gateway's namespace: `make` (a sandbox with fresh data, paused; its id),
# `resume ID` (seconds to connect and run a command), `pause ID`.
RESUME_CLIENT = """
import json, sys, time
from e2b import Sandbox
command, *args = sys.argv[1:]
if command == "make":
    sandbox = Sandbox.create("base", timeout=3600)
    sandbox.commands.run("head -c 16777216 /dev/urandom > /home/user/data")
    sandbox.pause()
    print(json.dumps(sandbox.sandbox_id))
elif command == "resume":
    start = time.perf_counter()
    Sandbox.connect(args[0], timeout=3600).commands.run("true")
    print(json.dumps(time.perf_counter() - start))
else:
    print(json.dumps(Sandbox.pause(args[0])))
"""


async def resume(scratch: Path, samples: int = 3) -> dict[str, Any]:
    beat = {"AENV_HEARTBEAT_INTERVAL": "2"}
    async with on_cluster(scratch, ["node-a", "node-b"], beat, shared_repository=True) as on:

        def client_run(*args: str) -> Any:
            return on.client(RESUME_CLIENT, *args)

        sandbox_id = client_run("make")
        same: list[float] = []
        for _ in range(samples):
            same.append(client_run("resume", sandbox_id))
            client_run("pause", sandbox_id)
        other: list[float] = []
        moved: list[int] = []
        for _ in range(samples):
            node = await on.routes.lookup(sandbox_id)
            assert node is not None
            on.aenv("node", "drain", node)
            other.append(client_run("resume", sandbox_id))
            target = await on.routes.lookup(sandbox_id)
            assert target is not None and target != node
            moved.append(sandbox_bytes(scratch / target, sandbox_id))
            on.aenv("node", "undrain", node)
            client_run("pause", sandbox_id)
    same_ms, other_ms = summary_ms(same), summary_ms(other)
    return {
        "samples": samples,
        "resume_same_node_ms": same_ms,
        "resume_other_node_ms": other_ms,
        "other_over_same_p50": round(other_ms["median"] / same_ms["median"], 2),
        "bytes_moved_per_resume": moved,
    }


# Runs in the gateway's namespace: N concurrent creates, timed, then killed; the seconds.
CREATES_CLIENT = """
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
from e2b import Sandbox
count = int(sys.argv[1])
start = time.perf_counter()
with ThreadPoolExecutor(count) as pool:
    made = list(pool.map(lambda _: Sandbox.create("base", timeout=600), range(count)))
spent = time.perf_counter() - start
for sandbox in made:
    sandbox.kill()
print(json.dumps(spent))
"""


async def creates(scratch: Path, batch: int = 4, rounds: int = 3) -> dict[str, Any]:
    async with on_cluster(scratch, ["node-a", "node-b"]) as on:

        def rate() -> float:
            return batch / float(on.client(CREATES_CLIENT, str(batch)))

        rate()  # warm-up: both nodes' pools and caches
        one: list[float] = []
        two: list[float] = []
        for _ in range(rounds):
            on.aenv("node", "drain", "node-b")
            one.append(rate())
            on.aenv("node", "undrain", "node-b")
            two.append(rate())
    one_rate, two_rate = sorted(one)[len(one) // 2], sorted(two)[len(two) // 2]
    return {
        "batch": batch,
        "rounds": rounds,
        "creates_per_s_one_node": [round(r, 3) for r in one],
        "creates_per_s_two_nodes": [round(r, 3) for r in two],
        "two_over_one_median": round(two_rate / one_rate, 2),
    }


# Runs in the gateway's namespace: N creates at once; their time, count and failures, then the
# started ones killed.
BURST_CLIENT = """
import collections, json, sys, time
from concurrent.futures import ThreadPoolExecutor
from e2b import Sandbox
count = int(sys.argv[1])
def one(_):
    try:
        return Sandbox.create("base", timeout=600, request_timeout=1800)
    except Exception as error:
        return f"{type(error).__name__}: {str(error)[:600]}"
start = time.perf_counter()
with ThreadPoolExecutor(count) as pool:
    made = list(pool.map(one, range(count)))
spent = time.perf_counter() - start
started = [s for s in made if not isinstance(s, str)]
with ThreadPoolExecutor(16) as pool:
    list(pool.map(lambda s: s.kill(), started))
failed = collections.Counter(s for s in made if isinstance(s, str))
print(json.dumps({"seconds": spent, "started": len(started), "failed": failed}))
"""


async def burst(scratch: Path, count: int = 200) -> dict[str, Any]:
    nodes = ["node-a", "node-b", "node-c"]
    async with on_cluster(scratch, nodes) as on:

        def once() -> dict[str, Any]:
            result: dict[str, Any] = on.client(BURST_CLIENT, str(count))
            result["creates_per_s"] = round(result["started"] / result["seconds"], 3)
            result["seconds"] = round(result["seconds"], 1)
            return result

        for node in nodes[1:]:
            on.aenv("node", "drain", node)
        one = once()
        for node in nodes[1:]:
            on.aenv("node", "undrain", node)
        three = once()
        leaked = {node: sorted(await on.routes.of_node(node)) for node in nodes}
    return {
        "count": count,
        "one_node": one,
        "three_nodes": three,
        "three_over_one_creates_per_s": round(three["creates_per_s"] / one["creates_per_s"], 2),
        "routes_left": leaked,
    }


CREATES = 500


def gateway_cpu(scratch: Path, samples: int = CREATES) -> dict[str, Any]:
    import os
    import secrets
    from contextlib import ExitStack

    import httpx
    import psutil

    from aenv.api.keys import KeyStore
    from aenv.cluster.registry import NodeReport
    from aenv.config import Paths
    from aenv.orchestrator.catalog import Catalog
    from tests.cluster.node_double import NodeDouble
    from tests.cluster.shared import SECRET as DOUBLES_SECRET  # the doubles' gate checks it
    from tests.proxy.support import serve
    from tests.support.ports import free_port
    from tests.support.process_group import stop_group

    with ExitStack() as stack:
        server = stack.enter_context(redis_server(scratch))
        node_keys = KeyStore(scratch / "node-keys.json")
        node_keys.create("node")

        async def register(addresses: dict[str, str]) -> None:
            client = connect(server.url)
            registry = NodeRegistry(client, DOUBLES_SECRET)
            for name, address in addresses.items():
                capacity = Capacity(64, 262144, 131072, running=0, paused=0)
                report = NodeReport(name, address, capacity, ["base"])
                await registry.heartbeat(secrets.token_hex(8), report, ttl=3600)
            await client.aclose()

        addresses = {}
        for name in ("a", "b"):
            double = NodeDouble(name, scratch / name, Catalog(scratch / f"{name}.db"))
            port = free_port()
            stack.enter_context(serve(double.app(node_keys), port))
            addresses[name] = f"127.0.0.1:{port}"
        asyncio.run(register(addresses))
        port = free_port()
        home = scratch / "gateway"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_")}
        env |= {"AENV_HOME": str(home), "AENV_REDIS_URL": server.url,
                "AENV_CLUSTER_SECRET": DOUBLES_SECRET.value, "AENV_KEY_REQUEST_BURST": "100000",
                "AENV_KEY_REQUESTS_PER_S": "100000"}  # fmt: skip
        gateway = subprocess.Popen(
            [sys.executable, "-m", "aenv.cli", "gateway", "--port", str(port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        stack.callback(stop_group, gateway, 10)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 204:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway never answered")
            time.sleep(0.2)
        key = Paths(home).api_key.read_text().strip()
        process = psutil.Process(gateway.pid)

        def cpu_ms_per_call(call: Callable[[httpx.Client], httpx.Response]) -> float:
            with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=30) as http:
                call(http)  # warm: connections and caches
                before = process.cpu_times()
                for _ in range(samples):
                    answer = call(http)
                    assert answer.status_code < 300, answer.text
                after = process.cpu_times()
            spent = (after.user - before.user) + (after.system - before.system)
            return spent * 1000 / samples

        health = cpu_ms_per_call(lambda http: http.get("/health"))
        create = cpu_ms_per_call(lambda http: http.post("/sandboxes", json={"templateID": "base"}))
    return {
        "simulation": "node doubles without VMs: the gateway's own CPU only",
        "calls": samples,
        "gateway_cpu_ms_per_create": round(create, 3),
        "gateway_cpu_ms_per_health": round(health, 3),
        "create_over_health": round(create / health, 2),
    }


def main() -> None:
    if sys.argv[1:] == ["gateway-cpu"]:
        with tempfile.TemporaryDirectory(prefix="aenv-bench-gwcpu-") as tmp:
            print(json.dumps(gateway_cpu(Path(tmp)), indent=2))
        return
    # Each of these runs real nodes in a scratch directory of its own.
    on_nodes: dict[str, Callable[[Path], Coroutine[Any, Any, dict[str, Any]]]] = {
        "creates": creates,
        "resume": resume,
        "proxy": proxy,
    }
    if sys.argv[1:2] == ["burst"]:
        scratch = Path(tempfile.mkdtemp(prefix="aenv-bench-burst-"))
        try:
            count = int(sys.argv[2]) if len(sys.argv) > 2 else 200
            print(json.dumps(asyncio.run(burst(scratch, count)), indent=2))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return
    if len(sys.argv) == 2 and sys.argv[1] in on_nodes:
        scratch = Path(tempfile.mkdtemp(prefix=f"aenv-bench-{sys.argv[1]}-"))
        try:
            print(json.dumps(asyncio.run(on_nodes[sys.argv[1]](scratch)), indent=2))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return
    with (
        tempfile.TemporaryDirectory(prefix="aenv-bench-cluster-") as tmp,
        redis_server(Path(tmp)) as server,
    ):
        print(json.dumps(asyncio.run(run(server.url)), indent=2))


if __name__ == "__main__":
    main()
