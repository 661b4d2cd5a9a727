"""A real registry on loopback: Debian's docker-registry (distribution 2.8) with its storage in
a temp dir, anonymous, with htpasswd Basic auth, or with token auth against a realm we run."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.ports import free_port
from tests.support.wait import SAFETY_S, eventually_sync


@dataclass(frozen=True)
class Registry:
    host: str  # 127.0.0.1:PORT
    storage: Path

    def blob_file(self, digest: str) -> Path:
        hex_ = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hex_[:2] / hex_ / "data"


def htpasswd(path: Path, user: str, password: str) -> dict[str, Any]:
    line = subprocess.run(
        ["htpasswd", "-nbB", user, password], check=True, capture_output=True, text=True
    ).stdout.strip()
    path.write_text(line + "\n")
    return {"htpasswd": {"realm": "aenv-test", "path": str(path)}}


@contextmanager
def run_registry(workdir: Path, auth: dict[str, Any] | None = None) -> Iterator[Registry]:
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    storage = workdir / "storage"
    config: dict[str, Any] = {
        "version": 0.1,
        "log": {"level": "error", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}},
        "http": {"addr": f"127.0.0.1:{port}"},
    }
    if auth:
        config["auth"] = auth
    (workdir / "config.yml").write_text(json.dumps(config))  # JSON is YAML
    log = (workdir / "registry.log").open("wb")
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(workdir / "config.yml")], stdout=log, stderr=log
    )

    def answers() -> bool:
        assert proc.poll() is None, (workdir / "registry.log").read_text()
        try:
            return httpx.get(f"http://127.0.0.1:{port}/v2/").status_code in (200, 401)
        except httpx.TransportError:
            return False

    try:
        eventually_sync(answers, "the registry answered")
        yield Registry(f"127.0.0.1:{port}", storage)
    finally:
        proc.terminate()
        proc.wait(timeout=SAFETY_S)
        log.close()
