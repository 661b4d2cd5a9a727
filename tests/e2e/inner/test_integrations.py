"""RL harnesses from PyPI, unmodified, each in an environment of its own (made by
scripts/install-integrations.sh under build/integrations/), against this server: their E2B
providers build a template from a task image that a registry on loopback serves (reachable
from the server, which shares this namespace), then drive sandboxes of it. A harness whose
environment is not there is skipped, saying how to make it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox, SandboxQuery

from tests.e2e.inner.conftest import BASE
from tests.oci.images import Image, Layout, directory, entry, push, symlink
from tests.oci.registry import run_registry

REPO = Path(__file__).resolve().parents[3]
INTEGRATIONS = REPO / "build" / "integrations"
CLIENTS = REPO / "tests" / "e2e" / "integrations"


def harness_python(name: str) -> str:
    python = INTEGRATIONS / name / "bin" / "python"
    if not python.exists():
        pytest.skip(
            f"{name} is not installed: scripts/install-integrations.sh makes its environment "
            f"in {INTEGRATIONS / name} (`make install-test` runs it)"
        )
    return str(python)


def task_image() -> Image:
    """A small task image: a static busybox as every tool (`tar`, `base64`... the harnesses
    call), a `/bin/bash` that hands over to its shell (envd starts commands with
    `bash -l -c`), and root's and user's accounts."""
    bash = b'#!/bin/sh\nexec /bin/sh "$@"\n'
    passwd = b"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/bash\n"
    return Image(
        [[
            directory("bin"),
            entry("bin/busybox", Path("/bin/busybox").read_bytes(), mode=0o755),
            symlink("bin/sh", "busybox"),
            entry("bin/bash", bash, mode=0o755),
            *(symlink(f"bin/{tool}", "busybox") for tool in _applets()),
            directory("usr"),
            directory("usr/bin"),
            entry("usr/bin/install", _INSTALL, mode=0o755),
            directory("etc"),
            entry("etc/passwd", passwd),
            entry("etc/group", b"root:x:0:\nuser:x:1000:\n"),
            directory("root", mode=0o700),
            directory("tmp", mode=0o1777),
        ]],
        config={"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "Cmd": ["sh"]},
    )  # fmt: skip


# Debian's static busybox has no `install`, which harbor's template build calls as
# `install -d -m MODE DIR`: that much of it.
_INSTALL = b"""#!/bin/sh
[ "$1" = -d ] || { echo "install: only -d here" >&2; exit 1; }
shift
mode=
if [ "$1" = -m ]; then mode=$2; shift 2; fi
mkdir -p "$@" && { [ -z "$mode" ] || chmod "$mode" "$@"; }
"""


def _applets() -> list[str]:
    """Every tool the host's static busybox provides but the shell's own names."""
    listed = subprocess.run(
        ["/bin/busybox", "--list"], check=True, capture_output=True, text=True
    ).stdout.split()
    return [a for a in listed if a not in ("busybox", "sh", "bash")]


def _served_image(tmp_path: Path, registry_host: str, name: str) -> str:
    layout = Layout(tmp_path / "layout")
    layout.add("v1", task_image())
    ref = f"{registry_host}/rl/{name}:v1"
    push(layout, "v1", ref)
    return ref


def _run(python: str, *argv: str) -> dict[str, Any]:
    done = subprocess.run(
        [python, *argv], capture_output=True, text=True, timeout=1800, env=os.environ.copy()
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _delete_template(name: str) -> None:
    headers = {"X-API-Key": os.environ["E2B_API_KEY"]}
    httpx.delete(f"{BASE}/templates/{name}", headers=headers, timeout=60)


def _delete_templates(prefix: str) -> None:
    """Every template named `prefix`... (a harness names its own)."""
    headers = {"X-API-Key": os.environ["E2B_API_KEY"]}
    listed = httpx.get(f"{BASE}/templates", headers=headers, timeout=60).json()
    for template in listed:
        if any(str(n).startswith(prefix) for n in template.get("names") or ()):
            _delete_template(template["templateID"])


def _running(metadata: dict[str, str]) -> list[str]:
    found = Sandbox.list(query=SandboxQuery(metadata=metadata)).next_items()
    return [s.sandbox_id for s in found]


def test_verifiers_e2b_runtime_runs_a_rollouts_operations(tmp_path: Path) -> None:
    python = harness_python("verifiers")
    seen: dict[str, Any] = {}
    with run_registry(tmp_path / "registry") as registry:
        ref = _served_image(tmp_path, registry.host, "verifiers")
        try:
            seen = _run(python, str(CLIENTS / "verifiers_client.py"), ref)
        finally:
            if seen.get("template"):
                _delete_template(seen["template"])
    assert seen["template"].startswith("vf-"), seen
    assert seen["run"] == [3, "out\n", "err\n"], seen
    assert seen["env"] == "hello in /app as 0\n", seen
    assert seen["program"] == [5, "program\n"], seen
    assert seen["read_back"] is True and seen["capped"] == "SandboxError", seen
    assert seen["process"] == [0, "got a line\n"], seen
    assert seen["alive"] is True, seen
    assert seen["expose"].startswith("https://8000-" + seen["sandbox"]), seen
    assert seen["stopped"] is True
    assert _running({"runtime": "verifiers"}) == []


HARBOR_TASK = {
    "task.toml": (
        'schema_version = "1.4"\n\n[metadata]\n\n[verifier]\ntimeout_sec = 600.0\n\n'
        "[agent]\ntimeout_sec = 600.0\n\n[environment]\nbuild_timeout_sec = 1200.0\n"
        "cpus = 1\nmemory_mb = 512\n"
    ),
    "instruction.md": "Write the word `solved` into /app/answer.txt.\n",
    "solution/solve.sh": "#!/bin/bash\necho solved > /app/answer.txt\n",
    "tests/test.sh": (
        '#!/bin/bash\nif [ "$(cat /app/answer.txt)" = solved ]; then\n'
        "  echo 1 > /logs/verifier/reward.txt\nelse\n  echo 0 > /logs/verifier/reward.txt\nfi\n"
    ),
}


def test_harbor_e2b_environment_runs_a_task_with_its_oracle_agent(tmp_path: Path) -> None:
    """`harbor run` with its `e2b` environment and its oracle agent on a task of ours: the
    environment builds a template from the task's Dockerfile (FROM the loopback registry's
    image), the oracle runs the task's solution in a sandbox of it, the verifier its tests;
    the reward is 1 and the sandbox is gone after."""
    python = harness_python("harbor")
    task = tmp_path / "task"
    for name, text in HARBOR_TASK.items():
        (task / name).parent.mkdir(parents=True, exist_ok=True)
        (task / name).write_text(text)
    jobs = tmp_path / "jobs"
    with run_registry(tmp_path / "registry") as registry:
        ref = _served_image(tmp_path, registry.host, "harbor")
        (task / "environment").mkdir()
        (task / "environment" / "Dockerfile").write_text(f"FROM {ref}\nWORKDIR /app\n")
        harbor = str(Path(python).with_name("harbor"))
        try:
            done = subprocess.run(
                [harbor, "run", "-p", str(task), "-a", "oracle", "-e", "e2b", "-o", str(jobs),
                 "--yes"],
                capture_output=True, text=True, timeout=3600, env=os.environ.copy(),
                cwd=tmp_path,
            )  # fmt: skip
        finally:
            _delete_templates("harbor-")
    results = [json.loads(p.read_text()) for p in jobs.glob("*/*/result.json")]
    assert done.returncode == 0 and len(results) == 1, (
        done.stdout[-4000:] + done.stderr[-4000:] + repr(results)
    )
    (result,) = results
    assert result["exception_info"] is None, result["exception_info"]
    assert result["verifier_result"]["rewards"] == {"reward": 1}, result["verifier_result"]
    assert _running({"harbor.trial_name": result["trial_name"]}) == []
