"""Template builds through the unmodified SDK against real VMs: RUN, COPY, ENV, WORKDIR and a
start command whose service sandboxes resume into, the step cache on a rebuild, and builds that
fail (a failing RUN, a readyCmd that never succeeds) listed as errors that nothing starts from."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template, wait_for_port
from e2b.exceptions import BuildException
from e2b.template.logger import LogEntry
from e2b.template.main import TemplateFinal

from aenv.config import Paths
from tests.oci.images import Layout, push
from tests.oci.registry import htpasswd, run_registry
from tests.oci.test_rootfs import busybox_image

BASE = "http://127.0.0.1:3000"


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def _context(tmp_path: Path) -> Path:
    app = tmp_path / "app"
    app.mkdir()
    (app / "hello.txt").write_text("hello from the build context\n")
    (app / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (app / "run.sh").chmod(0o755)
    return tmp_path


def _web(context: Path, marker: str, greeting: str = "hi there") -> TemplateFinal:
    return (
        Template(file_context_path=str(context))
        .from_template("base")
        .run_cmd(f"echo {marker} > /tmp/built.txt")
        .copy("app", "/home/user/app")
        .set_envs({"GREETING": greeting})
        .set_workdir("/home/user/app")
        .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000))
    )


def _serves_hello_on_8000(sandbox: Sandbox) -> None:
    """The service the start command left running answers through the proxy, at the host the
    SDK builds for port 8000."""
    assert sandbox.get_host(8000).startswith("8000-")
    response = httpx.get(
        f"{BASE}/hello.txt",
        headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8000"},
        timeout=30,
    )
    assert response.status_code == 200
    assert response.text == "hello from the build context\n"


def _templates() -> list[dict[str, object]]:
    headers = {"X-API-Key": os.environ["E2B_API_KEY"]}
    response = httpx.get(f"{BASE}/v2/templates", headers=headers, timeout=30)
    response.raise_for_status()
    listed: list[dict[str, object]] = response.json()
    return listed


def _names(status: str = "ready") -> set[str]:
    """Names of the listed templates whose newest build has `status`."""
    return {
        str(n)
        for t in _templates()
        if t["buildStatus"] == status
        for n in t["names"]  # type: ignore[attr-defined]
    }


def _delete(name: str) -> None:
    headers = {"X-API-Key": os.environ["E2B_API_KEY"]}
    httpx.delete(f"{BASE}/templates/{name}", headers=headers, timeout=60)


def test_build_copy_env_workdir_and_a_live_service(tmp_path: Path) -> None:
    name = _name("web")
    context = _context(tmp_path)
    logs: list[LogEntry] = []
    try:
        info = Template.build(_web(context, "first"), alias=name, on_build_logs=logs.append)
        assert info.template_id
        assert name in _names()
        messages = [e.message for e in logs]
        assert not any("CACHED" in m for m in messages), messages

        sandbox = Sandbox.create(name, timeout=120)
        try:
            result = sandbox.commands.run(
                'echo "$GREETING|$PWD|$(id -un)"; cat hello.txt /tmp/built.txt; ./run.sh; '
                "stat -c %U app 2>/dev/null; stat -c '%U %a' run.sh"
            )
            lines = result.stdout.splitlines()
            assert lines[0] == "hi there|/home/user/app|user"
            assert lines[1:4] == ["hello from the build context", "first", "ran"]
            assert lines[-1] == "user 755"
            # The start command kept running into the saved state: the service answers at once.
            _serves_hello_on_8000(sandbox)
        finally:
            sandbox.kill()

        # One changed step after the unchanged RUN and COPY: those two come from the cache.
        logs.clear()
        changed = _web(context, "first", greeting="changed")
        Template.build(changed, alias=name, on_build_logs=logs.append)
        cached = [e.message for e in logs if "CACHED" in e.message]
        assert any("RUN echo first" in m for m in cached), cached
        assert any("COPY app" in m for m in cached), cached
        sandbox = Sandbox.create(name, timeout=120)
        try:
            assert sandbox.commands.run("echo $GREETING").stdout == "changed\n"
        finally:
            sandbox.kill()
    finally:
        _delete(name)


def test_failing_run_step_is_a_build_error() -> None:
    name = _name("bad-run")
    logs: list[LogEntry] = []
    template = Template().from_template("base").run_cmd("echo about to fail; exit 3")
    with pytest.raises(BuildException, match="exited with code 3"):
        Template.build(template, alias=name, on_build_logs=logs.append)
    assert any("about to fail" in e.message for e in logs)
    assert any(e.level == "error" for e in logs)
    assert name not in _names()
    assert name in _names("error")
    assert not Template.exists(name)


def test_ready_command_that_never_succeeds_is_a_build_error() -> None:
    name = _name("never-ready")
    template = (
        Template().from_template("base").set_start_cmd("sleep 100000", "test -e /tmp/never-there")
    )
    with pytest.raises(BuildException, match="readyCmd did not succeed"):
        Template.build(template, alias=name)
    assert name not in _names()


def test_unknown_base_and_bad_requests() -> None:
    with pytest.raises(BuildException, match="not found"):
        Template.build(Template().from_template("no-such-template"), alias=_name("orphan"))
    headers = {"X-API-Key": os.environ["E2B_API_KEY"]}
    bad = httpx.post(f"{BASE}/v3/templates", json={"name": "Not Valid!"}, headers=headers)
    assert bad.status_code == 400
    assert bad.json()["code"] == 400
    missing = httpx.get(f"{BASE}/templates/nope/builds/nope/status", headers=headers)
    assert missing.status_code == 404


def _aenv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aenv.cli", *args], capture_output=True, text=True, timeout=900
    )


def test_cli_build_and_logs(tmp_path: Path) -> None:
    name = _name("cli")
    context = _context(tmp_path)
    definition = {
        "name": name,
        "fromTemplate": "base",
        "steps": [
            {"run": "id -un > /tmp/who.txt", "user": "root"},
            {"copy": {"src": "app/hello.txt", "dest": "/opt/greeting.txt", "mode": "0640"}},
            {"env": {"FROM_FILE": "yes"}},
            {"workdir": "/opt"},
        ],
    }
    (context / "aenv.yaml").write_text(json.dumps(definition))
    try:
        built = _aenv("template", "build", str(context / "aenv.yaml"), "--json")
        assert built.returncode == 0, built.stderr
        ids = json.loads(built.stdout)
        assert "[1/4] RUN id -un" in built.stderr
        sandbox = Sandbox.create(name, timeout=120)
        try:
            result = sandbox.commands.run(
                "cat /tmp/who.txt greeting.txt; echo $FROM_FILE $PWD; stat -c '%U %a' greeting.txt"
            )
            assert result.stdout.splitlines() == [
                "root",
                "hello from the build context",
                "yes /opt",
                "user 640",
            ]
        finally:
            sandbox.kill()
        logs = _aenv("template", "logs", ids["templateID"], ids["buildID"])
        assert logs.returncode == 0, logs.stderr
        assert "COPY app/hello.txt /opt/greeting.txt" in logs.stdout
        assert "ready" in logs.stderr
        missing = _aenv("template", "logs", ids["templateID"], "no-such-build")
        assert missing.returncode == 1 and "404" in missing.stderr

        assigned = Template.assign_tags(f"{name}:latest", ["stable", "v1"])
        assert assigned.build_id == ids["buildID"]
        tags = {t.tag: t.build_id for t in Template.get_tags(ids["templateID"])}
        assert tags == dict.fromkeys(["latest", "stable", "v1"], ids["buildID"])
        Template.remove_tags(name, ["v1"])
        assert {t.tag for t in Template.get_tags(ids["templateID"])} == {"latest", "stable"}
    finally:
        _delete(name)


def test_build_with_its_own_cpu_and_memory() -> None:
    """`cpu_count`/`memory_mb`: the build boots the base's disks at that size, and sandboxes of
    the template have those vCPUs and that memory (inside the guest, not only in the API)."""
    name = _name("sized")
    template = Template().from_template("base").run_cmd("echo sized > /tmp/sized.txt")
    try:
        Template.build(template, alias=name, cpu_count=2, memory_mb=512)
        sandbox = Sandbox.create(name, timeout=120)
        try:
            info = sandbox.get_info()
            assert (info.cpu_count, info.memory_mb) == (2, 512)
            assert sandbox.commands.run("nproc").stdout.strip() == "2"
            meminfo = sandbox.commands.run("grep MemTotal /proc/meminfo").stdout
            total_kib = int(meminfo.split()[1])
            assert 400 * 1024 < total_kib <= 512 * 1024, total_kib
            assert sandbox.files.read("/tmp/sized.txt") == "sized\n"
        finally:
            sandbox.kill()
    finally:
        _delete(name)
    headers = {"X-API-Key": os.environ["E2B_API_KEY"]}
    for bad in ({"cpuCount": 0}, {"memoryMB": 511}, {"memoryMB": 64}):
        response = httpx.post(
            f"{BASE}/v3/templates", json={"name": name, **bad}, headers=headers, timeout=30
        )
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["code"] == 400


def test_build_from_an_image(tmp_path: Path) -> None:
    """An image without bash, libc or Python from a registry on loopback (reachable from the
    server, which shares this namespace): its Env reaches RUN steps and sandboxes; COPY, ENV and
    WORKDIR apply; its busybox httpd, started by the start command and polled by the ready
    command, answers through the proxy as soon as a sandbox exists."""
    layout = Layout(tmp_path / "layout")
    layout.add("v1", busybox_image())
    name = _name("img")
    context = _context(tmp_path)
    with run_registry(tmp_path / "registry") as registry:
        ref = f"{registry.host}/test/busybox:v1"
        push(layout, "v1", ref)
        template = (
            Template(file_context_path=str(context))
            .from_image(ref)
            .run_cmd('echo "$GREETING from $(/bin/busybox id -un) in $PWD" > /tmp/built.txt')
            .copy("app", "/srv/www")
            .set_envs({"EXTRA": "set"})
            .set_workdir("/srv/www")
            # The SDK's commands.run needs bash, which this image lacks: look from a RUN step.
            .run_cmd('echo "$EXTRA $PWD $(cat hello.txt)" > /tmp/env.txt')
            .set_start_cmd(
                "busybox httpd -f -p 8000 -h /srv/www",
                "busybox wget -q -O /dev/null http://127.0.0.1:8000/hello.txt",
            )
        )
        try:
            Template.build(template, alias=name)
            sandbox = Sandbox.create(name, timeout=120)
            try:
                assert sandbox.files.read("/tmp/built.txt") == "a=b from user in /work\n"
                env = sandbox.files.read("/tmp/env.txt")
                assert env == "set /srv/www hello from the build context\n"
                _serves_hello_on_8000(sandbox)
            finally:
                sandbox.kill()
        finally:
            _delete(name)
        with pytest.raises(BuildException, match="image"):
            Template.build(Template().from_image(f"{registry.host}/test/nope:v1"), alias=name)
    assert name not in _names()


DOCKERFILE = """\
FROM {image}
ARG WHO=builder
ENV GREETING="hello" \\
    PLACE=dockerfile
COPY app /srv/www
WORKDIR /srv/www
RUN echo "$GREETING from $WHO in $PWD as $(busybox id -un)" > /tmp/built.txt
USER user
RUN echo "$PLACE $(busybox id -un) $(cat hello.txt)" > /tmp/env.txt
EXPOSE 8000
"""


def test_build_from_a_dockerfile(tmp_path: Path) -> None:
    """`Template.from_dockerfile`: the SDK turns FROM into the image (from a registry on
    loopback), ARG and ENV into ENV steps, COPY, WORKDIR, USER and RUN into theirs; all of
    them apply in order, and the start command set after it serves."""
    layout = Layout(tmp_path / "layout")
    layout.add("v1", busybox_image())
    name = _name("dockerfile")
    context = _context(tmp_path)
    with run_registry(tmp_path / "registry") as registry:
        ref = f"{registry.host}/test/busybox:v1"
        push(layout, "v1", ref)
        template = (
            Template(file_context_path=str(context))
            .from_dockerfile(DOCKERFILE.format(image=ref))
            .set_start_cmd(
                "busybox httpd -f -p 8000 -h /srv/www",
                "busybox wget -q -O /dev/null http://127.0.0.1:8000/hello.txt",
            )
        )
        try:
            Template.build(template, alias=name)
            sandbox = Sandbox.create(name, timeout=120)
            try:
                built = sandbox.files.read("/tmp/built.txt")
                assert built == "hello from builder in /srv/www as root\n"
                env = sandbox.files.read("/tmp/env.txt")
                assert env == "dockerfile user hello from the build context\n"
                _serves_hello_on_8000(sandbox)
            finally:
                sandbox.kill()
        finally:
            _delete(name)


def test_build_cache_keeps_only_the_newest_layers() -> None:
    """The server runs with `build_cache_layers` = 3 here and the builds above saved more step
    layers than that: the oldest are gone, files and all, and the newest still serve."""
    home = Path(os.environ["AENV_HOME"])
    kept = []
    for meta in Paths(home).templates.glob("layer-*/template.json"):
        template = json.loads(meta.read_text())
        if not template["deleted"]:
            kept.append(template["template_id"])
    assert 1 <= len(kept) <= 3, kept
    hidden = [p for p in Paths(home).templates.glob("layer-*") if p.name not in kept]
    assert hidden == [], "trimmed layers left files behind"


def test_image_builds_that_cannot_pull_fail_with_the_reason(tmp_path: Path) -> None:
    """A registry that refuses the credentials and a digest that is not there: each build
    ends in `error` with the reason in its log, and nothing is listed."""
    layout = Layout(tmp_path / "layout")
    layout.add("v1", busybox_image())
    name = _name("nopull")
    auth = htpasswd(tmp_path / "htpasswd", "alice", "right")
    with run_registry(tmp_path / "registry", auth) as registry:
        ref = f"{registry.host}/test/busybox:v1"
        push(layout, "v1", ref, creds="alice:right")
        logs: list[LogEntry] = []
        wrong = Template().from_image(ref, username="alice", password="wrong")
        with pytest.raises(BuildException, match="authentication failed"):
            Template.build(wrong, alias=name, on_build_logs=logs.append)
        assert any("authentication failed" in e.message for e in logs), logs
        missing = f"{registry.host}/test/busybox@sha256:{'0' * 64}"
        absent = Template().from_image(missing, username="alice", password="right")
        with pytest.raises(BuildException, match="image"):
            Template.build(absent, alias=name)
    assert name not in _names()
