"""Wire-level Connect behaviour the SDKs depend on, checked with raw HTTP: stream framing and
event order, keepalives, Connect-Timeout-Ms bounding a process, tag selectors, old-client
defaults, unary content types."""

from __future__ import annotations

import base64
from typing import Any

import httpx
from e2b import Sandbox

from tests.envd.helpers import (
    STREAM_HEADERS,
    UNARY_HEADERS,
    envelope,
    parse_envelopes,
    pids_in_sandbox,
    unique_sleep,
)
from tests.support.wait import eventually_sync


def _start(url: str, body: dict[str, Any], **headers: str) -> list[tuple[int, Any]]:
    response = httpx.post(
        f"{url}/process.Process/Start",
        content=envelope(body),
        headers={**STREAM_HEADERS, **headers},
        timeout=60,
    )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/connect+json"
    return parse_envelopes(response.content)


def _bash(command: str, **extra: Any) -> dict[str, Any]:
    return {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", command]}, "stdin": False, **extra}


def _events(frames: list[tuple[int, Any]]) -> list[dict[str, Any]]:
    assert frames[-1] == (2, {})  # a clean end-of-stream frame
    assert all(flags == 0 for flags, _ in frames[:-1])
    return [message["event"] for _, message in frames[:-1]]


def test_start_stream_framing(envd_url: str) -> None:
    events = _events(_start(envd_url, _bash("echo out; echo err >&2; exit 3")))
    assert list(events[0]) == ["start"]
    assert events[0]["start"]["pid"] > 0
    data = [e["data"] for e in events[1:-1]]
    stdout = b"".join(base64.b64decode(d["stdout"]) for d in data if "stdout" in d)
    stderr = b"".join(base64.b64decode(d["stderr"]) for d in data if "stderr" in d)
    assert (stdout, stderr) == (b"out\n", b"err\n")
    assert events[-1] == {
        "end": {"exitCode": 3, "exited": True, "status": "exit status 3", "error": "exit status 3"}
    }


def test_successful_end_event_has_no_error(envd_url: str) -> None:
    events = _events(_start(envd_url, _bash("true")))
    assert events[-1] == {"end": {"exited": True, "status": "exit status 0"}}


def test_killed_end_event(sandbox: Sandbox, envd_url: str) -> None:
    handle = sandbox.commands.run("sleep 1000", background=True)
    handle.disconnect()
    frames: list[tuple[int, Any]] = []
    with httpx.stream(
        "POST",
        f"{envd_url}/process.Process/Connect",
        content=envelope({"process": {"pid": handle.pid}}),
        headers=STREAM_HEADERS,
        timeout=60,
    ) as response:
        chunks = response.iter_raw()
        first = next(chunks)
        assert sandbox.commands.kill(handle.pid)
        frames = parse_envelopes(first + b"".join(chunks))
    events = _events(frames)
    assert events[0] == {"start": {"pid": handle.pid}}
    assert events[-1] == {
        "end": {"exitCode": -1, "status": "signal: killed", "error": "signal: killed"}
    }


def test_keepalives_on_idle_process_stream(envd_url: str) -> None:
    frames = _start(envd_url, _bash("sleep 2.5; echo done"), **{"Keepalive-Ping-Interval": "1"})
    events = _events(frames)
    kinds = [next(iter(e)) for e in events]
    assert kinds[0] == "start"
    assert kinds[-1] == "end"
    assert "keepalive" in kinds
    assert events[kinds.index("keepalive")] == {"keepalive": {}}


def test_connect_timeout_bounds_the_process(sandbox: Sandbox, envd_url: str) -> None:
    command = unique_sleep()
    frames = _start(envd_url, _bash(f"{command}; echo never"), **{"Connect-Timeout-Ms": "500"})
    assert list(frames[0][1]["event"]) == ["start"]
    assert frames[-1] == (
        2,
        {"error": {"code": "deadline_exceeded", "message": "context deadline exceeded"}},
    )
    eventually_sync(lambda: not pids_in_sandbox(sandbox, command))


def test_connect_timeout_on_connect_leaves_process_running(sandbox: Sandbox, envd_url: str) -> None:
    command = unique_sleep()
    handle = sandbox.commands.run(command, background=True)
    try:
        response = httpx.post(
            f"{envd_url}/process.Process/Connect",
            content=envelope({"process": {"pid": handle.pid}}),
            headers={**STREAM_HEADERS, "Connect-Timeout-Ms": "300"},
            timeout=60,
        )
        frames = parse_envelopes(response.content)
        assert frames[0] == (0, {"event": {"start": {"pid": handle.pid}}})
        assert frames[-1][1]["error"]["code"] == "deadline_exceeded"
        # Only the stream timed out; the process is untouched.
        assert pids_in_sandbox(sandbox, command)
    finally:
        handle.kill()


def test_tag_selector(envd_url: str) -> None:
    tag = "aenv-tagged"
    with httpx.stream(
        "POST",
        f"{envd_url}/process.Process/Start",
        content=envelope({**_bash("read x; echo got $x"), "tag": tag, "stdin": True}),
        headers=STREAM_HEADERS,
        timeout=60,
    ) as response:
        chunks = response.iter_raw()
        body = next(chunks)
        pid = parse_envelopes(body)[0][1]["event"]["start"]["pid"]
        listed = httpx.post(
            f"{envd_url}/process.Process/List", content=b"{}", headers=UNARY_HEADERS
        ).json()
        mine = [p for p in listed["processes"] if p["pid"] == pid]
        assert mine[0]["tag"] == tag
        sent = httpx.post(
            f"{envd_url}/process.Process/SendInput",
            json={"process": {"tag": tag}, "input": {"stdin": base64.b64encode(b"t\n").decode()}},
            headers={"Connect-Protocol-Version": "1"},
        )
        assert sent.status_code == 200
        frames = parse_envelopes(body + b"".join(chunks))
    events = _events(frames)
    out = b"".join(base64.b64decode(e["data"]["stdout"]) for e in events if "data" in e)
    assert out == b"got t\n"


def test_start_without_stdin_field_keeps_stdin_open(envd_url: str) -> None:
    # Clients from before envd 0.3.0 omit `stdin` and expect it open.
    with httpx.stream(
        "POST",
        f"{envd_url}/process.Process/Start",
        content=envelope({"process": {"cmd": "/bin/cat"}}),
        headers=STREAM_HEADERS,
        timeout=60,
    ) as response:
        chunks = response.iter_raw()
        body = next(chunks)
        pid = parse_envelopes(body)[0][1]["event"]["start"]["pid"]
        for path, payload in (
            ("SendInput", {"process": {"pid": pid}, "input": {"stdin": "aGk="}}),  # "hi"
            ("CloseStdin", {"process": {"pid": pid}}),
        ):
            r = httpx.post(
                f"{envd_url}/process.Process/{path}", json=payload, headers=UNARY_HEADERS
            )
            assert r.status_code == 200, r.text
        frames = parse_envelopes(body + b"".join(chunks))
    events = _events(frames)
    assert b"".join(base64.b64decode(e["data"]["stdout"]) for e in events if "data" in e) == b"hi"


def test_unary_response_format(envd_url: str) -> None:
    response = httpx.post(
        f"{envd_url}/filesystem.Filesystem/Stat",
        json={"path": "/home/user"},
        headers={"Connect-Protocol-Version": "1"},
    )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    entry = response.json()["entry"]
    assert entry["type"] == "FILE_TYPE_DIRECTORY"
    assert entry["path"] == "/home/user"
    assert entry["owner"] == "user"
    assert entry["permissions"] == "drwxr-xr-x"
    assert entry["mode"] == 0o755
    # Snake-case field names and numeric enums are accepted on input.
    listed = httpx.post(
        f"{envd_url}/filesystem.Filesystem/ListDir",
        content=b'{"path": "/home", "depth": "1"}',
        headers=UNARY_HEADERS,
    )
    assert listed.status_code == 200
    assert [e["name"] for e in listed.json()["entries"]] == ["user"]
    signal = httpx.post(
        f"{envd_url}/process.Process/SendSignal",
        content=b'{"process": {"pid": 999999}, "signal": 9}',
        headers=UNARY_HEADERS,
    )
    assert signal.json()["code"] == "not_found"


def test_health_and_is_running(sandbox: Sandbox, envd_url: str) -> None:
    assert httpx.get(f"{envd_url}/health").status_code == 204
    assert sandbox.is_running() is True


def test_rpc_request_compression(sandbox: Sandbox, envd_url: str) -> None:
    import gzip

    url = f"{envd_url}/filesystem.Filesystem/Stat"
    body = b'{"path": "/home/user"}'
    ok = httpx.post(
        url, content=gzip.compress(body), headers={**UNARY_HEADERS, "Content-Encoding": "gzip"}
    )
    assert ok.status_code == 200
    assert ok.json()["entry"]["name"] == "user"
    broken = httpx.post(url, content=body, headers={**UNARY_HEADERS, "Content-Encoding": "gzip"})
    assert (broken.status_code, broken.json()["code"]) == (400, "invalid_argument")
    unknown = httpx.post(url, content=body, headers={**UNARY_HEADERS, "Content-Encoding": "br"})
    assert (unknown.status_code, unknown.json()["code"]) == (501, "unimplemented")
    stream = httpx.post(
        f"{envd_url}/process.Process/Start",
        content=envelope(gzip.compress(b'{"process": {"cmd": "/bin/true"}}'), flags=1),
        headers={**STREAM_HEADERS, "Connect-Content-Encoding": "gzip"},
    )
    assert parse_envelopes(stream.content)[-1] == (2, {})
    assert sandbox.commands.run("echo ok").stdout == "ok\n"


def test_cors_for_browser_clients(envd_url: str) -> None:
    origin = {"Origin": "https://app.example"}
    asked = "content-type,connect-protocol-version,x-access-token"
    preflight = httpx.options(
        f"{envd_url}/process.Process/Start",
        headers={
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": asked,
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert preflight.headers["access-control-allow-methods"] == "POST"
    assert preflight.headers["access-control-allow-headers"] == asked
    actual = httpx.post(
        f"{envd_url}/process.Process/List", content=b"{}", headers={**UNARY_HEADERS, **origin}
    )
    assert actual.status_code == 200
    assert actual.headers["access-control-allow-origin"] == "*"
    assert "Grpc-Status" in actual.headers["access-control-expose-headers"]
    files = httpx.get(f"{envd_url}/files", params={"path": "/nope"}, headers=origin)
    assert files.status_code == 404
    assert files.headers["access-control-allow-origin"] == "*"
    # Without an Origin nothing changes.
    plain = httpx.post(f"{envd_url}/process.Process/List", content=b"{}", headers=UNARY_HEADERS)
    assert "access-control-allow-origin" not in plain.headers
