"""The sandbox's env vars (`Sandbox.create(envs=...)`), as envd reports them at `GET /envs`.

The server and its warm kernels start while the template is built, long before any sandbox of
it has env vars: envd gets them at the sandbox's `/init`. So each kernel is given them before
its first execution, and again in a clone (a fork, a snapshot's sandbox), whose envs may differ:
they are asked of envd once per sandbox (its hostname, `incarnation`), as E2B's server asks
envd once per context, with the access token the SDK sent (envd wants it when the sandbox has
one).
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request

from aenv.code_interpreter import incarnation

log = logging.getLogger(__name__)

# envd's port in every sandbox.
ENVD_URL = "http://127.0.0.1:49983"
_TIMEOUT_S = 10.0


class SandboxEnv:
    def __init__(self, envd_url: str | None) -> None:
        """`envd_url`: where envd answers (http); None: there is none, and no sandbox env vars."""
        if envd_url is not None and not envd_url.startswith("http://"):
            raise ValueError(f"envd's URL is not an http:// one: {envd_url!r}")
        self._url = envd_url
        self._cache: tuple[str, dict[str, str]] | None = None
        self._lock = asyncio.Lock()

    async def get(self, token: str | None) -> dict[str, str]:
        """The sandbox's env vars; empty (and logged) when envd does not answer with them, so
        that code still runs."""
        now = incarnation.current()
        async with self._lock:
            if self._cache is None or self._cache[0] != now:
                self._cache = (now, await asyncio.to_thread(self._fetch, token))
            return self._cache[1]

    def _fetch(self, token: str | None) -> dict[str, str]:
        if self._url is None:
            return {}
        headers = {"X-Access-Token": token} if token else {}
        # An http:// URL (checked above), not a file or other scheme.
        request = urllib.request.Request(f"{self._url}/envs", headers=headers)  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:  # noqa: S310
                envs = json.load(response)
        except (OSError, ValueError) as e:  # urllib's errors are OSErrors
            log.warning("no sandbox env vars: envd at %s did not give them: %s", self._url, e)
            return {}
        if not isinstance(envs, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in envs.items()
        ):
            log.warning("no sandbox env vars: envd's /envs is not an object of strings")
            return {}
        return envs
