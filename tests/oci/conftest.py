"""One anonymous registry for the module's tests; each test pushes images under its own name."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.oci.images import Image, Layout, Publish, directory, entry, push
from tests.oci.registry import Registry, run_registry


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with run_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture
def publish(registry: Registry, tmp_path: Path) -> Publish:
    """publish(*images) -> a fresh reference on the registry holding them (an index if many)."""

    def publish_(*images: Image, tag: str = "v1") -> str:
        layout = Layout(tmp_path / f"layout-{secrets.token_hex(4)}")
        layout.add(tag, *images)
        ref = f"{registry.host}/test/img{secrets.token_hex(4)}:{tag}"
        push(layout, tag, ref)
        return ref

    return publish_


def simple_image(text: bytes = b"hello\n", **kw: object) -> Image:
    return Image([[directory("etc"), entry("etc/greeting", text)]], **kw)  # type: ignore[arg-type]
