"""Registries that need credentials: htpasswd Basic auth, and Bearer tokens from a realm
(docker-registry's token auth against a token server run by the test)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.oci import AuthError, Credentials, pull
from tests.oci.conftest import simple_image
from tests.oci.images import Layout, push
from tests.oci.registry import Registry, htpasswd, run_registry
from tests.oci.token_auth import TokenRealm, run_token_realm

GOOD = Credentials("alice", "s3cret")


def publish_to(registry: Registry, tmp_path: Path) -> str:
    layout = Layout(tmp_path / f"layout-{secrets.token_hex(4)}")
    layout.add("v1", simple_image(b"private\n"))
    ref = f"{registry.host}/private/app:v1"
    push(layout, "v1", ref, creds=f"{GOOD.username}:{GOOD.password}")
    return ref


@pytest.fixture(scope="module")
def basic_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    work = tmp_path_factory.mktemp("basic")
    with run_registry(work, htpasswd(work / "htpasswd", GOOD.username, GOOD.password)) as reg:
        yield reg


@pytest.fixture(scope="module")
def realm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenRealm]:
    with run_token_realm(tmp_path_factory.mktemp("realm"), {GOOD.username: GOOD.password}) as r:
        yield r


@pytest.fixture(scope="module")
def token_registry(
    realm: TokenRealm, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Registry]:
    with run_registry(tmp_path_factory.mktemp("token"), realm.registry_auth()) as reg:
        yield reg


async def test_basic_auth(basic_registry: Registry, tmp_path: Path) -> None:
    ref = publish_to(basic_registry, tmp_path)
    image = await pull(ref, tmp_path / "oci", credentials=GOOD)
    assert len(image.layers) == 1
    with pytest.raises(AuthError, match="requires credentials"):
        await pull(ref, tmp_path / "oci")
    with pytest.raises(AuthError, match=r"authentication failed.*as alice"):
        await pull(ref, tmp_path / "oci", credentials=Credentials("alice", "wrong"))


async def test_token_auth(token_registry: Registry, realm: TokenRealm, tmp_path: Path) -> None:
    ref = publish_to(token_registry, tmp_path)
    realm.requests.clear()
    image = await pull(ref, tmp_path / "oci", credentials=GOOD)
    assert len(image.layers) == 1
    # One token for the whole pull, scoped to pulling this repository.
    assert realm.requests == ["repository:private/app:pull"]
    with pytest.raises(AuthError, match=r"token request refused.*anonymously"):
        await pull(ref, tmp_path / "oci2")
    with pytest.raises(AuthError, match=r"token request refused.*as alice"):
        await pull(ref, tmp_path / "oci2", credentials=Credentials("alice", "wrong"))
