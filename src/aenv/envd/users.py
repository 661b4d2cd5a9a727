"""Guest user accounts: who a request runs as, and how its paths resolve.

The SDK selects a user with `Authorization: Basic base64("<name>:")` on RPC calls and with the
`username` query parameter on `/files`; without one, the sandbox's default user applies.
"""

from __future__ import annotations

import base64
import binascii
import os
import posixpath
import pwd
from dataclasses import dataclass


class UnknownUserError(Exception):
    """The requested account does not exist in the guest."""

    def __init__(self, name: str) -> None:
        super().__init__(f"invalid username: '{name}'")
        self.name = name


@dataclass(frozen=True, slots=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    groups: tuple[int, ...]

    @classmethod
    def lookup(cls, name: str) -> User:
        try:
            entry = pwd.getpwnam(name)
        except (KeyError, ValueError):  # (ValueError: a NUL byte in the name)
            raise UnknownUserError(name) from None
        try:
            groups = tuple(os.getgrouplist(name, entry.pw_gid))
        except OSError:
            groups = (entry.pw_gid,)
        return cls(name, entry.pw_uid, entry.pw_gid, entry.pw_dir or "/", groups)


def username_from_basic_auth(header: str | None) -> str | None:
    """The user name in a `Basic` authorization header, or None when there is no usable header."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic" or not token:
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    name, _, _password = decoded.partition(":")
    return name or None


def resolve_path(path: str, user: User, default_workdir: str | None) -> str:
    """Resolve a request path the way envd does: empty -> default workdir, `~` -> home,
    relative -> under the user's home; always returns a clean absolute path."""
    if "\x00" in path:
        raise ValueError(f"path {path!r} contains a NUL byte")
    if not path and default_workdir:
        path = default_workdir
    if path.startswith("~"):
        if len(path) > 1 and path[1] != "/":
            raise ValueError(f"cannot expand user-specific home dir in '{path}'")
        path = user.home + path[1:]
    if not posixpath.isabs(path):
        path = posixpath.join(user.home, path)
    return posixpath.normpath(path)
