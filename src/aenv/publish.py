"""Publishing `code-interpreter-v1` on a node's start: the template `e2b-code-interpreter`'s
`Sandbox.create()` asks for, built from its definition in the repository
(`aenv/code_interpreter/template.yaml`) when the node does not have it yet.

It runs in the background once the node serves, so neither `base` nor the node's readiness
waits for it; it builds through the node's own template API with the `e2b` SDK, exactly as
`aenv template build` does, so its log is a build's log (`aenv template logs`) and its steps
are cached layers a later try reuses. Its build is reserved before the node serves, so from
the first request until it is ready, creating a sandbox of it answers E2B's "has no ready
build" (404). A failed build is logged and tried again, with backoff, while the node runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2b import Template
from e2b.exceptions import BuildException, FileUploadException, TemplateException

import aenv.code_interpreter
from aenv.config import Config, ConfigError
from aenv.orchestrator.build_records import Build
from aenv.orchestrator.builds import Builder
from aenv.orchestrator.templates import TemplateNotFound, TemplateStore
from aenv.template_definition import DefinitionError, read_definition, sdk_template

log = logging.getLogger(__name__)

DEFINITION = Path(aenv.code_interpreter.__file__).parent / "template.yaml"
_SERVING_POLL_S = 0.2
RETRY_FIRST_S = 30.0
RETRY_MAX_S = 3600.0


@dataclass(frozen=True)
class Published:
    """The definition a node publishes, read before the node makes anything."""

    path: Path
    definition: dict[str, Any]

    @classmethod
    def read(cls, config: Config) -> Published:
        """`code_interpreter_definition` (or the package's), read and checked; ConfigError for
        a file that is not a definition."""
        path = config.code_interpreter_definition or DEFINITION
        try:
            return cls(path, read_definition(path))
        except DefinitionError as e:
            raise ConfigError(f"code_interpreter_definition: {e}") from e


def own_api_url(config: Config) -> str | None:
    """Where this node's API answers from this host; None when the SDK could not verify it
    (HTTPS: its certificate names the domain, not a loopback address)."""
    if config.tls_cert is not None:
        return None
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host  # noqa: S104
    return f"http://{host}:{config.port}"


@dataclass(frozen=True)
class Publication:
    """code-interpreter-v1's build, reserved before the node serves (`reserve`) and run through
    the node's own API once it does (`run`)."""

    published: Published
    url: str
    api_key: str
    templates: TemplateStore
    builder: Builder
    build: Build

    @classmethod
    def reserve(
        cls, config: Config, published: Published, templates: TemplateStore, builder: Builder
    ) -> Publication | None:
        """The publication of `published` to run, its build already waiting so that creates
        answer "has no ready build" from the first request on; None when the template exists
        (or behind TLS)."""
        path, name = published.path, str(published.definition["name"])
        with contextlib.suppress(TemplateNotFound):
            templates.get(name)
            return None
        url = own_api_url(config)
        if url is None:
            log.warning("not publishing %s behind TLS: run `aenv template build %s`", name, path)
            return None
        api_key = config.paths.api_key.read_text().strip()
        return cls(published, url, api_key, templates, builder, builder.reserve(name))

    async def run(self, serving: Callable[[], bool], retry_after: float = RETRY_FIRST_S) -> None:
        """Build once `serving()` says the API answers. A failed build is tried again while
        the node runs (a registry down for a while, say): `retry_after` seconds later, then
        twice as long after each failure, at most `RETRY_MAX_S`; not once the template exists
        (someone built it meanwhile)."""
        try:
            # uvicorn sets a flag once it listens, with no event to wait on.
            while not serving():  # noqa: ASYNC110
                await asyncio.sleep(_SERVING_POLL_S)
            delay = retry_after
            while not await self._build_once():
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                if self._exists():
                    return
        finally:
            # A no-op once the SDK's request has taken the reserved build over.
            self.builder.abandon(self.build, "publishing stopped before the build was requested")

    def _exists(self) -> bool:
        try:
            self.templates.get(self.build.name)
        except TemplateNotFound:
            return False
        return True

    async def _build_once(self) -> bool:
        """One build through the node's API; False when it failed (logged)."""
        name, definition = self.build.name, self.published.definition
        log.info("publishing %s in the background (`aenv template ls` shows it)", name)
        try:
            info = await asyncio.to_thread(
                Template.build,
                sdk_template(definition, self.published.path.parent),
                name,
                cpu_count=definition.get("cpuCount"),
                memory_mb=definition.get("memoryMB"),
                api_key=self.api_key,
                api_url=self.url,
            )
        except (BuildException, FileUploadException, TemplateException) as e:
            log.warning("publishing %s failed (tried again while the node runs): %s", name, e)
            return False
        except Exception as e:  # the node serves on whatever broke here
            log.warning("publishing %s stopped (tried again while the node runs): %r", name, e)
            return False
        log.info("published %s (template %s)", name, info.template_id)
        return True
