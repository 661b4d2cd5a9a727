from __future__ import annotations

import pytest
from e2b import Sandbox, SandboxException


def test_sdk_2_45_uses_v1_create_and_connect() -> None:
    from importlib.metadata import version

    assert version("e2b").startswith("2.45.")
    sandbox = Sandbox.create(timeout=120, metadata={"sdk": "2.45"})  # POST /sandboxes
    try:
        assert sandbox.commands.run("echo v1").stdout == "v1\n"
        sandbox.files.write("/home/user/v1.txt", "old sdk")
        again = Sandbox.connect(sandbox.sandbox_id)  # POST /sandboxes/{id}/connect
        assert again.files.read("/home/user/v1.txt") == "old sdk"
        listed = [s.sandbox_id for s in Sandbox.list().next_items()]
        assert sandbox.sandbox_id in listed
    finally:
        assert Sandbox.kill(sandbox.sandbox_id)


def test_unimplemented_fields_are_refused_by_name() -> None:
    # 2.45 sends `mcp` through the v1 create route.
    with pytest.raises(SandboxException, match="field 'mcp' is not supported here"):
        Sandbox.create(mcp={"exa": {"apiKey": "x"}})
