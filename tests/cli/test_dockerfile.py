"""`aenv template build Dockerfile`: the build the SDK would send for a Dockerfile it carries
out whole, and a refusal naming each instruction or flag it would leave out, before any node is
asked (the e2e template build suite builds a Dockerfile on a node)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2b import Template

from aenv.cli.dockerfile import is_dockerfile, template_from_dockerfile

CARRIED_OUT = """\
FROM alpine:3.20
ARG WHO=builder
ENV GREETING=hi
COPY --chown=user --chmod=0755 app /srv/app
WORKDIR /srv/app
USER user
RUN echo "$GREETING $WHO" > /tmp/built.txt
EXPOSE 8000
CMD ["python3", "-m", "http.server"]
"""


def test_a_dockerfile_carried_out_whole_becomes_its_steps(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "run.sh").write_text("echo ran\n")
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(CARRIED_OUT)
    build = json.loads(Template.to_json(template_from_dockerfile(dockerfile)))
    assert build["fromImage"] == "alpine:3.20"
    kinds = [(s["type"], s["args"][0]) for s in build["steps"]]
    assert ("COPY", "app") in kinds and ("WORKDIR", "/srv/app") in kinds
    assert ("USER", "user") in kinds
    assert build["startCmd"] == "python3 -m http.server"


def test_spellings_of_a_dockerfile() -> None:
    for name in ("Dockerfile", "Dockerfile.dev", "web.Dockerfile"):
        assert is_dockerfile(Path(name))
    assert not is_dockerfile(Path("template.yaml"))


LEFT_OUT = """\
FROM alpine:3.20
HEALTHCHECK CMD true
SHELL ["/bin/sh", "-c"]
STOPSIGNAL SIGINT
VOLUME /data
ONBUILD RUN true
RUN --network=none true
ADD --checksum=sha256:0 a b
EXPOSE 8000
"""
NAMED = ["line 2: HEALTHCHECK", "line 3: SHELL", "line 4: STOPSIGNAL", "line 5: VOLUME",
         "line 6: ONBUILD", "line 7: RUN --network", "line 8: ADD --checksum"]  # fmt: skip


def test_what_a_build_would_leave_out_is_refused_by_name(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(LEFT_OUT)
    # No node runs here: the refusal comes first, or the command would fail on the node.
    home = tmp_path / "home"
    result = subprocess.run(
        [sys.executable, "-m", "aenv.cli", "template", "build", str(dockerfile), "--name", "x"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"AENV_HOME": str(home), "COLUMNS": "400", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 1
    output = " ".join((result.stdout + result.stderr).split())
    assert "not supported in a template build" in output
    for what in NAMED:
        assert what in output
    assert "EXPOSE" not in output  # metadata only: every port of a sandbox is reachable


def test_a_multi_stage_dockerfile_is_refused(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM alpine AS a\nFROM alpine\nCOPY --from=a /x /x\n")
    with pytest.raises(ValueError, match="Multi-stage"):
        template_from_dockerfile(dockerfile)
