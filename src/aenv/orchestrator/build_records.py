"""What a template build is (its request, state and failure) and its record on disk: the
JSON that `$AENV_HOME/builds/<build id>.json` holds, written when the build starts and ends, so
that a build outlives a restart (one cut short by it reads back as failed). The builder that
runs builds is `builds.py`."""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from dataclasses import dataclass, field

from aenv.ids import TEAM_ID
from aenv.oci import Credentials
from aenv.orchestrator.build_logs import BuildLog, LogEntry
from aenv.orchestrator.build_steps import StepType


class BuildStatus(enum.StrEnum):
    WAITING = "waiting"  # requested, its steps not yet given
    BUILDING = "building"
    READY = "ready"
    ERROR = "error"


RUNNING = frozenset({BuildStatus.WAITING, BuildStatus.BUILDING})


class BuildError(Exception):
    """What ends a build in `error`; `step` is the step it happened in, if any."""

    def __init__(self, message: str, step: str | None = None) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True)
class Step:
    type: StepType
    args: tuple[str, ...]
    force: bool = False
    files_hash: str | None = None


@dataclass(frozen=True)
class BuildSpec:
    from_template: str | None
    from_image: str | None
    steps: tuple[Step, ...]
    start_cmd: str | None = None
    ready_cmd: str | None = None
    force: bool = False
    # `fromImageRegistry` of type `registry`: user and password for the image's registry.
    credentials: Credentials | None = None


@dataclass
class Build:
    template_id: str
    build_id: str
    name: str
    tags: tuple[str, ...]
    created_at: float
    status: BuildStatus = BuildStatus.WAITING
    # The sandbox size asked for (`cpuCount`, `memoryMB`); None keeps the base's.
    cpu_count: int | None = None
    memory_mb: int | None = None
    reason: BuildError | None = None
    # The team that asked for it (a record written before teams: the default team's).
    team_id: str = TEAM_ID
    # Not part of the record: the log has a file of its own.
    journal: BuildLog | None = field(default=None, compare=False, repr=False)

    @property
    def logs(self) -> BuildLog:
        assert self.journal is not None, "a builder gives each build its log"
        return self.journal

    def log(self, message: str, level: str = "info", step: str | None = None) -> None:
        self.logs.append(LogEntry(time.time(), level, message, step))


def to_json(build: Build) -> str:
    """The build's record: all but its log, which has a file of its own."""
    reason = build.reason
    return json.dumps(
        {
            **{
                f.name: getattr(build, f.name)
                for f in dataclasses.fields(build)
                if f.name not in ("journal", "reason")
            },
            "reason": None if reason is None else {"message": str(reason), "step": reason.step},
        }
    )


def from_json(text: str) -> tuple[Build, list[LogEntry] | None]:
    """A build from its record, and the log an earlier version kept in it (None without)."""
    raw = json.loads(text)
    reason = raw.pop("reason")
    inline = raw.pop("logs", None)
    build = Build(**{**raw, "tags": tuple(raw["tags"]), "status": BuildStatus(raw["status"])})
    if reason is not None:
        build.reason = BuildError(reason["message"], reason["step"])
    if build.status in RUNNING:  # the server stopped
        build.reason = BuildError("interrupted: the server restarted during the build")
        build.status = BuildStatus.ERROR
    return build, None if inline is None else [LogEntry(**e) for e in inline]
