"""The Python SDK's `Template` options against the build routes, over a node on doubles served
on loopback: what each option sends is honoured (or refused by name), as the routes see it. The
builds themselves run on a real guest in tests/e2e/inner/test_template_build.py."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

from e2b import AsyncTemplate

from tests.api.test_routes import KEY, served
from tests.doubles.node import double_node


async def test_copy_with_force_upload_uploads_known_files_again(tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    (context / "app.txt").write_text("hello\n")
    async with double_node(tmp_path / "node") as node, served(node) as api:
        opts: dict[str, Any] = {"api_key": KEY, "api_url": str(api.base_url)}
        files = node.config.paths.build_files

        def template(force_upload: bool) -> Any:
            # The builds fail at their base, before COPY: a build's COPY would remove the
            # spoiled upload below (it no longer matches its files hash).
            base = AsyncTemplate(file_context_path=context).from_template("no-such-base")
            return base.copy("app.txt", "/app/", force_upload=True if force_upload else None)

        await AsyncTemplate.build_in_background(template(False), "app", **opts)
        (uploads,) = files.iterdir()  # the template's
        (stored,) = uploads.iterdir()
        # Spoil the stored upload: only an upload made again puts the files back.
        stored.write_bytes(b"spoiled")
        await AsyncTemplate.build_in_background(template(False), "app", **opts)
        assert stored.read_bytes() == b"spoiled"  # known, so not uploaded without the option
        await AsyncTemplate.build_in_background(template(True), "app", **opts)
        with tarfile.open(stored) as tar:
            assert "app.txt" in tar.getnames()
