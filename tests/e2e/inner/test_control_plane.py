from __future__ import annotations

import httpx
import pytest
from e2b import Sandbox, SandboxException, SandboxQuery

from tests.support.wait import eventually_sync


def test_create_info_list_kill() -> None:
    sandbox = Sandbox.create(metadata={"suite": "e2e"}, envs={"A": "1"}, timeout=120)
    try:
        info = sandbox.get_info()
        assert info.sandbox_id == sandbox.sandbox_id
        assert info.template_id == "base"
        assert info.metadata == {"suite": "e2e"}
        listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "e2e"})).next_items()
        assert [s.sandbox_id for s in listed] == [sandbox.sandbox_id]
    finally:
        assert sandbox.kill()
    assert not Sandbox.kill(sandbox.sandbox_id)


def test_unknown_template_is_a_clean_error() -> None:
    with pytest.raises(SandboxException) as err:
        Sandbox.create("no-such-template")
    assert "404" in str(err.value) or "not found" in str(err.value)


def test_bad_api_key_is_401(server: str) -> None:
    response = httpx.post(
        f"{server}/v2/sandboxes",
        json={"templateID": "base"},
        headers={"X-API-KEY": "e2b_" + "0" * 40},
    )
    assert response.status_code == 401
    assert set(response.json()) >= {"code", "message"}


def test_set_timeout_then_expiry_kills() -> None:

    sandbox = Sandbox.create(timeout=120)
    sandbox.set_timeout(2)
    try:
        eventually_sync(
            lambda: sandbox.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()],
            "the sandbox ended at its timeout",
            interval=0.5,
        )
    except AssertionError:
        sandbox.kill()
        raise


def test_metrics_come_from_inside_the_guest() -> None:
    sandbox = Sandbox.create(timeout=120)
    try:
        metrics = sandbox.get_metrics()
        assert len(metrics) >= 1  # the samples taken every 5 s, or a fresh one
        sample = metrics[-1]
        assert sample.cpu_count >= 1
        assert 0 < sample.mem_used < sample.mem_total
        assert 0 < sample.disk_used <= sample.disk_total
    finally:
        sandbox.kill()


def test_the_guest_is_set_up_to_sleep_when_idle() -> None:
    """What keeps an idle guest from waking (docs/density.md, "Idle CPU"), in the real template:
    our PID 1, our init's sysctls and the kernel command line."""
    sandbox = Sandbox.create(timeout=120)
    try:
        read = "cat /proc/1/comm /proc/sys/vm/stat_interval /proc/sys/vm/compaction_proactiveness"
        assert sandbox.commands.run(read).stdout.split() == ["aenv-init", "10", "0"]
        probe = "/proc/sys/net/ipv4/neigh/default/interval_probe_time_ms"
        assert sandbox.commands.run(f"cat {probe}").stdout.strip() == "3600000"
        assert "psi=0" in sandbox.commands.run("cat /proc/cmdline").stdout.split()
    finally:
        sandbox.kill()


def test_prometheus_metrics_count_creates(server: str) -> None:
    sandbox = Sandbox.create(timeout=60)
    try:
        text = httpx.get(f"{server}/metrics").text
        assert 'aenv_sandboxes{state="running"}' in text
        assert 'aenv_creates_total{result="success"}' in text
        assert "aenv_create_seconds_count" in text
        assert "aenv_create_queue 0.0" in text
    finally:
        sandbox.kill()


def test_nodes_match_the_openapi_schema(server: str) -> None:
    import os
    from pathlib import Path

    import jsonschema
    import yaml

    spec = yaml.safe_load(
        (Path(__file__).resolve().parents[3] / "specs" / "e2b" / "openapi.yml").read_text()
    )
    schemas = spec["components"]["schemas"]
    node_schema = {"$ref": "#/components/schemas/Node", "components": {"schemas": schemas}}
    key = os.environ["E2B_API_KEY"]
    nodes = httpx.get(f"{server}/nodes", headers={"X-API-KEY": key}).json()
    assert len(nodes) == 1
    jsonschema.validate(nodes[0], node_schema)
    assert nodes[0]["status"] == "ready"
