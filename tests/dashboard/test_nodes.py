"""The nodes page over HTTP: the node `GET /nodes` describes, live."""

from __future__ import annotations

import socket

from tests.dashboard.conftest import Site, page_client
from tests.dashboard.test_sessions import sign_in


async def test_the_node_is_listed_live(site: Site) -> None:
    async with page_client(site.dashboard) as browser:
        await sign_in(browser)
        await site.create()
        page = await browser.get("/dashboard/nodes")
        assert page.status_code == 200
        assert f'data-node="{socket.gethostname()}"' in page.text
        assert "1 (0)" in page.text  # its one sandbox, none starting
        live = await browser.get("/dashboard/nodes/live")
        assert "event: rows" in live.text and socket.gethostname() in live.text
