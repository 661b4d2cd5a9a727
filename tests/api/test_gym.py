"""`aenv.sdk.gym.SandboxEnv` over a node on doubles served on loopback (API and data plane on one
port, as `aenv server` serves them), with the unmodified E2B SDK. The double envd runs no
commands: it answers `ran <command>`, and exits N for `exit N` (tests/doubles/guest.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import gymnasium
import pytest
from e2b import CommandResult, Sandbox
from gymnasium.utils.env_checker import check_env

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from aenv.proxy.app import SandboxProxy
from aenv.sdk.gym import ENV_ID, SandboxEnv
from aenv.server import _Resolver
from tests.api.test_routes import KEY
from tests.doubles.guest import COMMANDS
from tests.doubles.node import DoubleNode, double_node
from tests.support import loopback_api


@asynccontextmanager
async def _served(node: DoubleNode) -> AsyncIterator[dict[str, Any]]:
    """The SDK's connection options for the node's API and data plane on a loopback port."""
    keys = KeyStore(node.config.home / "api-keys.json")
    keys.add(KEY, "test")
    api = create_api(node.orchestrator, node.config, keys)
    proxy = SandboxProxy(_Resolver(node.orchestrator), control_plane=api)
    try:
        async with loopback_api.served(proxy) as url:
            yield {"api_key": KEY, "api_url": url, "sandbox_url": url}
    finally:
        await proxy.aclose()


def _exit_code(sandbox: Sandbox, action: str, result: CommandResult) -> float:
    return float(result.exit_code)


def _exited_3(sandbox: Sandbox, action: str, result: CommandResult) -> bool:
    return result.exit_code == 3


async def test_steps_observe_commands_and_reset_restores_the_prepared_state(
    tmp_path: Path,
) -> None:
    async with double_node(tmp_path) as node, _served(node) as opts:
        env = await asyncio.to_thread(
            SandboxEnv,
            prepare=lambda sandbox: sandbox.commands.run("prepare"),
            reward=_exit_code,
            done=_exited_3,
            max_steps=2,
            max_command=16,
            **opts,
        )
        snapshot_id = env.snapshot_id
        try:

            def guest() -> Any:
                return node.guest(env.sandbox.sandbox_id)

            await asyncio.to_thread(check_env, env, skip_render_check=True)
            empty = {"stdout": "", "stderr": "", "exit_code": 0}
            assert await asyncio.to_thread(env.reset, seed=0) == (empty, {"steps": 0})
            stepped = await asyncio.to_thread(env.step, "echo h\u00e9")
            ran = {"stdout": "ran echo h?\n", "stderr": "", "exit_code": 0}
            assert stepped == (ran, 0.0, False, False, {"steps": 1})
            assert guest().read(COMMANDS) == "prepare\necho h\u00e9\n"
            exited = await asyncio.to_thread(env.step, "exit 3")
            ended = {"stdout": "ran exit 3\n", "stderr": "", "exit_code": 3}
            assert exited == (ended, 3.0, True, False, {"steps": 2})

            await asyncio.to_thread(env.reset)
            assert guest().read(COMMANDS) == "prepare\n"
            truncated = [(await asyncio.to_thread(env.step, "true"))[3] for _ in range(2)]
            assert truncated == [False, True]
            with pytest.raises(ValueError, match="snapshot"):
                env.reset(options={"snapshot": "other"})
            with pytest.raises(TypeError, match="shell command"):
                env.step(3)  # type: ignore[arg-type]
        finally:
            await asyncio.to_thread(env.close)
        await asyncio.to_thread(env.close)  # again: nothing
        assert not await asyncio.to_thread(Sandbox.delete_snapshot, snapshot_id, **opts)


async def test_from_a_snapshot_it_keeps_the_snapshot(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, _served(node) as opts:
        source = await asyncio.to_thread(Sandbox.create, "base", **opts)
        try:
            await asyncio.to_thread(source.commands.run, "prepare")
            snapshot = await asyncio.to_thread(source.create_snapshot)
        finally:
            await asyncio.to_thread(source.kill)
        with pytest.raises(ValueError, match="prepare"):
            SandboxEnv(snapshot_id=snapshot.snapshot_id, prepare=print, **opts)
        env = await asyncio.to_thread(SandboxEnv, snapshot_id=snapshot.snapshot_id, **opts)
        try:
            await asyncio.to_thread(env.reset)
            assert node.guest(env.sandbox.sandbox_id).read(COMMANDS) == "prepare\n"
        finally:
            await asyncio.to_thread(env.close)
        assert await asyncio.to_thread(Sandbox.delete_snapshot, snapshot.snapshot_id, **opts)


async def test_gymnasium_make_builds_it_by_its_registered_id(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, _served(node) as opts:
        env = await asyncio.to_thread(
            gymnasium.make, f"aenv.sdk.gym:{ENV_ID}", max_command=16, **opts
        )
        try:
            assert isinstance(env.unwrapped, SandboxEnv)
            # With a spec, check_env also builds and closes a second environment from it.
            await asyncio.to_thread(check_env, env.unwrapped, skip_render_check=True)
            await asyncio.to_thread(env.reset, seed=0)
            stepped = await asyncio.to_thread(env.step, "exit 1")
            assert stepped[0] == {"stdout": "ran exit 1\n", "stderr": "", "exit_code": 1}
        finally:
            await asyncio.to_thread(env.close)
