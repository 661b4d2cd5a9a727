"""Template definition files: the small E2B-style format (YAML or JSON, README "Template
builds") that `aenv template build` and the node's own publication of `code-interpreter-v1`
read, checked (`read_definition`) and turned into the `e2b` SDK's `Template` (`sdk_template`),
which builds it as any client would. Paths in COPY steps are relative to the file's directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from e2b import Template
from e2b.template.main import TemplateBuilder, TemplateFinal

# The keys of a definition; any other is refused rather than ignored.
DEFINITION_KEYS = ("name", "fromTemplate", "fromImage", "steps", "startCmd", "readyCmd",
                   "cpuCount", "memoryMB")  # fmt: skip
_ONE_PER_STEP = "one of run, copy, env, workdir, user per step"


class DefinitionError(ValueError):
    """A file that is not a definition, or a definition with a bad key or step; the message
    names what is wrong."""


def read_definition(path: Path) -> dict[str, Any]:
    """The definition in the file at `path`, its keys and sizes checked."""
    try:
        raw = yaml.safe_load(path.read_text())  # JSON is YAML too
    except (OSError, yaml.YAMLError) as e:
        raise DefinitionError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise DefinitionError(
            f"{path}: expected a mapping with fromTemplate or fromImage, steps, startCmd"
        )
    unknown = sorted(set(raw) - set(DEFINITION_KEYS))
    if unknown:
        raise DefinitionError(
            f"{path}: unknown keys {', '.join(unknown)}; known: {', '.join(DEFINITION_KEYS)}"
        )
    for key in ("cpuCount", "memoryMB"):
        if key in raw and (type(raw[key]) is not int or raw[key] < 1):
            raise DefinitionError(f"{path}: {key} must be a positive integer, not {raw[key]!r}")
    return raw


def sdk_template(definition: dict[str, Any], context: Path) -> TemplateBuilder | TemplateFinal:
    """The SDK template `definition` describes, its COPY sources under `context`."""
    template = Template(file_context_path=str(context))
    if "fromImage" in definition:
        builder = template.from_image(str(definition["fromImage"]))
    else:
        builder = template.from_template(str(definition.get("fromTemplate", "base")))
    for step in definition.get("steps") or []:
        # `user` beside `run` is the user of that command; alone it is a USER step.
        if (
            not isinstance(step, dict)
            or len(set(step) - ({"user"} if "run" in step else set())) != 1
        ):
            raise DefinitionError(
                f"bad step {step!r}: one of run, copy, env, workdir, user per step"
            )
        user = step.get("user") if "run" in step else None
        if "run" in step:
            builder = builder.run_cmd(str(step["run"]), user=user)
        elif "copy" in step:
            copy = step["copy"]
            if not isinstance(copy, dict) or "src" not in copy or "dest" not in copy:
                raise DefinitionError(f"bad copy step {copy!r}: needs src and dest")
            mode = copy.get("mode")
            builder = builder.copy(
                str(copy["src"]),
                str(copy["dest"]),
                user=copy.get("user"),
                mode=int(str(mode), 8) if mode is not None else None,
            )
        elif "env" in step and isinstance(step["env"], dict):
            builder = builder.set_envs({str(k): str(v) for k, v in step["env"].items()})
        elif "workdir" in step:
            builder = builder.set_workdir(str(step["workdir"]))
        elif "user" in step:
            builder = builder.set_user(str(step["user"]))
        else:
            raise DefinitionError(
                f"bad step {step!r}: one of run, copy, env, workdir, user per step"
            )
    if definition.get("startCmd"):
        ready = definition.get("readyCmd") or "true"
        return builder.set_start_cmd(str(definition["startCmd"]), str(ready))
    return builder
