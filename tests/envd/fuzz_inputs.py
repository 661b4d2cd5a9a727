"""Hypothesis strategies for hostile envd requests: Connect messages of every method (right and
wrong types, odd values), their encodings and headers, and HTTP route inputs.

Everything a strategy can make envd change stays inside one fuzz directory: mutating paths are
built under it from components that never climb out ("..") and commands come from a harmless
set, because envd runs as root of a throwaway root whose project, venv and /dev are the host's.
"""

from __future__ import annotations

import base64
import json
import posixpath
import struct
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

FUZZ_DIR = "/home/user/fuzz"

# Characters that have tripped path and header handling elsewhere: separators, NUL, control
# characters, non-ASCII, lone surrogates' UTF-8 escapes, shell and URL metacharacters.
_ODD = st.sampled_from(
    [
        "",
        ".",
        "~",
        "~root",
        " ",
        "\x00",
        "\n",
        "\t",
        "%00",
        "%2F",
        "é",
        "日本",
        "\u202e",
        "*",
        "?",
        "$HOME",
        "'",
        '"',
        "\\",
        "a" * 300,
        "b" * 5000,
        "\x7f",
        "\ufeff",
    ]
)
_TEXT = st.one_of(st.text(max_size=40), _ODD)
# One name of a path: odd, never empty, "." or "..".
path_components = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_characters="/"), min_size=1, max_size=30),
    _ODD,
).filter(lambda c: c not in ("", ".", ".."))

# Paths envd may create, move or remove: always inside FUZZ_DIR (or the directory itself).
mutable_paths = st.lists(path_components, max_size=4).map(
    lambda parts: "/".join([FUZZ_DIR, *parts])
)

# Paths envd may only read or watch: the mutable ones, relative and home-relative forms, and
# fixed oddities (files with no size, directories, missing, too long, a NUL byte).
readable_paths = st.one_of(
    mutable_paths,
    _TEXT.map(lambda p: p.replace("..", "_")),
    st.sampled_from(
        [
            "",
            "/",
            "~",
            "~/",
            "~root/x",
            "/proc/self/status",
            "/proc/cpuinfo",
            "/dev/null",
            "/etc/passwd",
            "/nonexistent/x",
            "/etc/passwd/child",
            "/" + "x" * 5000,
            "/tmp/\x00x",
            "relative/path",
            "/home/user/../../etc/hostname",
        ]
    ),
)

# Programs a fuzzed Start may run: harmless ones, missing ones and invalid names (a random
# word could name a real program, so invented names carry a prefix no program has).
commands = st.one_of(
    st.sampled_from(
        [
            "/bin/true",
            "/bin/false",
            "echo",
            "/bin/echo",
            "",
            "/",
            "/etc/passwd",
            "/nonexistent",
            "/home/user",
            "ech\x00o",
        ]
    ),
    _TEXT.map(lambda t: f"aenv-no-such-program-{t}"),
)

# Integers around every boundary a uint32/int32/int64 field or an fd/pid/size can have.
odd_ints = st.one_of(
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**64, -(2**63)]),
    st.integers(min_value=-(2**70), max_value=2**70),
)

# A JSON value of the wrong kind for whatever field it lands in.
wrong_json = st.one_of(
    st.none(),
    st.booleans(),
    odd_ints,
    st.floats(allow_nan=False),
    _TEXT,
    st.lists(st.integers(), max_size=3),
    st.dictionaries(_TEXT, st.integers(), max_size=3),
)


def _maybe_wrong(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly `value`, sometimes a JSON value of the wrong type."""
    return st.one_of(value, value, value, wrong_json)


def _fields(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A JSON object with any subset of `fields` (each possibly of the wrong type), and
    sometimes an unknown field."""
    return st.fixed_dictionaries(
        {}, optional={name: _maybe_wrong(s) for name, s in fields.items()} | {"noSuchField": _TEXT}
    )


_b64 = st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode())
_pty = _fields(size=_fields(cols=odd_ints, rows=odd_ints))
_selector = st.one_of(
    _fields(pid=odd_ints), _fields(tag=_TEXT), _fields(pid=odd_ints, tag=_TEXT)
)  # (both members of the oneof at once is malformed)
_input = st.one_of(_fields(stdin=_b64), _fields(pty=_b64), _fields(stdin=_b64, pty=_b64))
_signals = st.one_of(
    st.sampled_from(["SIGNAL_UNSPECIFIED", "SIGNAL_SIGTERM", "SIGNAL_SIGKILL", "SIGSTOP"]),
    odd_ints,
)


@dataclass(frozen=True)
class Method:
    """One Connect method: its URL path, whether it streams responses, and its request
    messages as JSON objects (the proto message type decodes the binary form)."""

    path: str
    streams: bool
    requests: st.SearchStrategy[dict[str, Any]]
    message: type[Any] = field(compare=False)


def methods() -> list[Method]:
    from aenv.envd.proto.filesystem import filesystem_pb as fs
    from aenv.envd.proto.process import process_pb as pr

    process = _fields(
        cmd=commands,
        args=st.lists(_TEXT, max_size=4),
        envs=st.dictionaries(_TEXT, _TEXT, max_size=3),
        cwd=readable_paths,
    )
    watch = _fields(
        path=mutable_paths,
        recursive=st.booleans(),
        includeEntry=st.booleans(),
        allowNetworkMounts=st.booleans(),
    )
    return [
        Method("/filesystem.Filesystem/Stat", False, _fields(path=readable_paths), fs.StatRequest),
        Method(
            "/filesystem.Filesystem/MakeDir", False, _fields(path=mutable_paths), fs.MakeDirRequest
        ),
        Method(
            "/filesystem.Filesystem/Move",
            False,
            _fields(source=mutable_paths, destination=mutable_paths),
            fs.MoveRequest,
        ),
        Method(
            "/filesystem.Filesystem/ListDir",
            False,
            _fields(path=readable_paths, depth=odd_ints),
            fs.ListDirRequest,
        ),
        Method(
            "/filesystem.Filesystem/Remove", False, _fields(path=mutable_paths), fs.RemoveRequest
        ),
        Method("/filesystem.Filesystem/WatchDir", True, watch, fs.WatchDirRequest),
        Method("/filesystem.Filesystem/CreateWatcher", False, watch, fs.CreateWatcherRequest),
        Method(
            "/filesystem.Filesystem/GetWatcherEvents",
            False,
            _fields(watcherId=_TEXT),
            fs.GetWatcherEventsRequest,
        ),
        Method(
            "/filesystem.Filesystem/RemoveWatcher",
            False,
            _fields(watcherId=_TEXT),
            fs.RemoveWatcherRequest,
        ),
        Method(
            "/process.Process/Start",
            True,
            _fields(process=process, pty=_pty, tag=_TEXT, stdin=st.booleans()),
            pr.StartRequest,
        ),
        Method("/process.Process/Connect", True, _fields(process=_selector), pr.ConnectRequest),
        Method("/process.Process/List", False, _fields(), pr.ListRequest),
        Method(
            "/process.Process/SendInput",
            False,
            _fields(process=_selector, input=_input),
            pr.SendInputRequest,
        ),
        Method(
            "/process.Process/SendSignal",
            False,
            _fields(process=_selector, signal=_signals),
            pr.SendSignalRequest,
        ),
        Method(
            "/process.Process/Update",
            False,
            _fields(process=_selector, pty=_pty),
            pr.UpdateRequest,
        ),
        Method(
            "/process.Process/CloseStdin", False, _fields(process=_selector), pr.CloseStdinRequest
        ),
    ]


def encoded(message: dict[str, Any], message_class: type[Any], binary: bool) -> bytes:
    """The message as JSON text, or as protobuf binary when it is valid for its type (else its
    JSON bytes, which a proto decoder must refuse)."""
    text = json.dumps(message)
    if not binary:
        return text.encode()
    try:
        return bytes(message_class.from_json(text).to_binary())
    except Exception:
        return text.encode()


_SAFE_COMMANDS = frozenset({"", "/bin/true", "/bin/false", "echo", "/bin/echo"})


def _harmless(value: Any) -> bool:
    """Whether a decoded request (as JSON) only touches the fuzz area: every path it names is
    under the user's home and every command is a harmless one."""
    if isinstance(value, list):
        return all(_harmless(v) for v in value)
    if not isinstance(value, dict):
        return True
    for key, item in value.items():
        if key in ("path", "source", "destination") and isinstance(item, str):
            resolved = posixpath.normpath(posixpath.join("/home/user", item.lstrip("~")))
            if not (resolved + "/").startswith("/home/user/"):
                return False
        elif (key == "cmd" and item not in _SAFE_COMMANDS) or not _harmless(item):
            return False
    return True


def _decodes_harmless(payload: bytes, message_class: type[Any]) -> bool:
    """Random bytes may decode to any request (a Remove of "/", a Start of any program): keep
    only those that do not decode, or decode to a harmless one."""
    for decode in (message_class.from_binary, message_class.from_json):
        try:
            message = decode(payload)
        except Exception:
            continue
        if not _harmless(json.loads(message.to_json())):
            return False
    return True


@st.composite
def bodies(draw: st.DrawFn, method: Method) -> tuple[str, bytes]:
    """(content type, body) for a request to `method`: mostly well framed, sometimes not."""
    binary = draw(st.booleans())
    payload = draw(
        st.one_of(
            st.builds(encoded, method.requests, st.just(method.message), st.just(binary)),
            st.binary(max_size=200).filter(lambda b: _decodes_harmless(b, method.message)),
            st.sampled_from([b"", b"{", b"null", b"[]", b'"x"', b"\xff\xfe", b"{}" * 1000]),
        )
    )
    codec = "proto" if binary else "json"
    if method.streams:
        content_type = f"application/connect+{codec}"
        flags = draw(st.sampled_from([0, 0, 0, 1, 2, 0x80]))
        length = draw(st.one_of(st.just(len(payload)), st.integers(0, 2**32 - 1)))
        body = struct.pack(">BI", flags, length) + payload
        body = draw(st.sampled_from([body, body, body[:3], body + body]))
    else:
        content_type, body = f"application/{codec}", payload
    content_type = draw(
        st.one_of(
            st.just(content_type),
            st.sampled_from(
                [
                    "",
                    "text/plain",
                    "application/grpc",
                    "application/connect+json",
                    "application/json; charset=latin1",
                    "multipart/form-data",
                ]
            ),
        )
    )
    return content_type, body


_header_value = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30
) | st.sampled_from(["-1", "0", "1e400", "nan", "99999999999999999999", "1.5"])


@st.composite
def rpc_headers(draw: st.DrawFn) -> dict[str, str]:
    """Connect headers with odd values: timeouts, keepalive, encodings, Basic-auth users."""
    headers: dict[str, str] = {}
    if draw(st.booleans()):
        headers["Connect-Protocol-Version"] = draw(st.sampled_from(["1", "2", ""]))
    for name in (
        "Connect-Timeout-Ms",
        "Keepalive-Ping-Interval",
        "Connect-Content-Encoding",
        "Content-Encoding",
        "Connect-Accept-Encoding",
    ):
        if draw(st.integers(0, 3)) == 0:
            headers[name] = draw(st.one_of(_header_value, st.sampled_from(["gzip", "br"])))
    if draw(st.booleans()):
        user = draw(st.one_of(st.sampled_from(["user", "root", "nobody", ""]), _TEXT))
        raw = draw(st.one_of(st.just(f"{user}:"), _TEXT)).encode("utf-8", "surrogatepass")
        scheme = draw(st.sampled_from(["Basic ", "basic ", "Bearer ", ""]))
        headers["Authorization"] = scheme + base64.b64encode(raw).decode()
    return headers
