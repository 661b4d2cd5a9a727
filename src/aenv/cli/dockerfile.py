"""`aenv template build` of a Dockerfile: the `e2b` SDK's `Template.from_dockerfile`, but only
for a Dockerfile all of whose instructions and flags a template build carries out.

The SDK turns a Dockerfile into build steps on the client (FROM into the image; RUN, COPY, ADD,
ENV, ARG, WORKDIR and USER into steps; CMD and ENTRYPOINT into the start command) and leaves out
the rest with a printed warning: such a Dockerfile would build into something else than it says,
and the node never sees what was left out. So here it is refused, naming what would be dropped.
EXPOSE, LABEL and MAINTAINER only describe the image (every port of a sandbox is reachable), and
pass.
"""

from __future__ import annotations

from pathlib import Path

from e2b import Template
from e2b.template.main import TemplateBuilder
from e2b_dockerfile_utils import DockerfileSyntaxError, parse_dockerfile_ast

# Instruction -> the flags the SDK carries out (it drops the others).
CARRIED_OUT: dict[str, frozenset[str]] = {
    "FROM": frozenset(),
    "RUN": frozenset(),
    "COPY": frozenset({"chown", "chmod", "from"}),
    "ADD": frozenset({"chown", "chmod", "from"}),
    "ENV": frozenset(),
    "ARG": frozenset(),
    "WORKDIR": frozenset(),
    "USER": frozenset(),
    "CMD": frozenset(),
    "ENTRYPOINT": frozenset(),
    "EXPOSE": frozenset(),
    "LABEL": frozenset(),
    "MAINTAINER": frozenset(),
}


class UnsupportedDockerfile(ValueError):
    """The Dockerfile has instructions or flags a template build would leave out."""


def is_dockerfile(path: Path) -> bool:
    """`Dockerfile`, `Dockerfile.NAME` or `NAME.Dockerfile`, Docker's own spellings."""
    name = path.name
    return name == "Dockerfile" or name.startswith("Dockerfile.") or name.endswith(".Dockerfile")


def unsupported(content: str) -> list[str]:
    """What a template build of this Dockerfile would leave out, one `line N: WHAT` each."""
    found = []
    for instruction in parse_dockerfile_ast(content).instructions:
        where = f"line {instruction.start_line}"
        flags = CARRIED_OUT.get(instruction.name)
        if flags is None:
            found.append(f"{where}: {instruction.name}")
            continue
        for flag in instruction.flags:
            name = flag.removeprefix("--").partition("=")[0]
            if name not in flags:
                found.append(f"{where}: {instruction.name} --{name}")
    return found


def template_from_dockerfile(path: Path) -> TemplateBuilder:
    """The build of the Dockerfile at `path`, COPY sources relative to its directory.
    UnsupportedDockerfile when a build would leave part of it out."""
    content = path.read_text()
    try:
        dropped = unsupported(content)
        if dropped:
            raise UnsupportedDockerfile(
                f"{path}: not supported in a template build: {'; '.join(dropped)}"
            )
        return Template(file_context_path=str(path.resolve().parent)).from_dockerfile(content)
    except DockerfileSyntaxError as e:
        raise UnsupportedDockerfile(f"{path}: {e}") from e
