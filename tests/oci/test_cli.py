"""`aenv pull` as a user runs it: JSON output, the cache under AENV_HOME, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.oci.conftest import simple_image
from tests.oci.images import Publish
from tests.oci.registry import Registry

AENV = str(Path(sys.executable).parent / "aenv")


def aenv_pull(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [AENV, "pull", *args, "--home", str(home)], capture_output=True, text=True, timeout=120
    )


def test_pull_json(publish: Publish, tmp_path: Path) -> None:
    ref = publish(simple_image(config={"Env": ["A=1"]}))
    done = aenv_pull(ref, "--json", home=tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["reference"] == ref and out["platform"] == "linux/amd64"
    assert out["digest"].startswith("sha256:") and out["config"] == {"Env": ["A=1"]}
    (layer,) = out["layers"]
    blob = tmp_path / "cache" / "oci" / "blobs" / "sha256" / layer["digest"][7:]
    assert blob.stat().st_size == layer["size"]

    text = aenv_pull(ref, home=tmp_path)
    assert text.returncode == 0 and f"digest   {out['digest']}" in text.stdout
    assert layer["digest"] in text.stdout


def test_pull_errors(registry: Registry, tmp_path: Path) -> None:
    for ref, message in [
        (f"{registry.host}/test/missing:v1", "not found"),
        ("Not A Reference", "bad repository name"),
    ]:
        done = aenv_pull(ref, home=tmp_path)
        assert done.returncode == 1 and message in done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
