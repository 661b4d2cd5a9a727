"""Firecracker's swagger (the shared spec file) as JSON-schema validators, for tests.

`Swagger.validate(definition, body)` checks a body against one definition; `Swagger.operation`
finds the body definition of a (method, path) the way Firecracker routes it. Objects are made
strict (`additionalProperties: false` where the swagger says nothing) because Firecracker
deserializes with `deny_unknown_fields`: a misspelt field is an error there, so it is one here.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[3]
SPEC_PATH = Path(
    os.environ.get("AENV_FIRECRACKER_SWAGGER", REPO / "specs" / "firecracker" / "firecracker.yaml")
)


@dataclass(frozen=True)
class Operation:
    method: str
    template: str
    body_definition: str | None
    body_required: bool


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if out.get("type") == "object" and "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


class Swagger:
    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw
        self.definitions: dict[str, Any] = _strict(copy.deepcopy(raw["definitions"]))
        self.operations: list[Operation] = []
        for template, item in raw["paths"].items():
            for method, op in item.items():
                body = next((p for p in op.get("parameters", []) if p["in"] == "body"), None)
                ref = body["schema"]["$ref"].rsplit("/", 1)[-1] if body else None
                required = bool(body and body.get("required", False))
                self.operations.append(Operation(method.upper(), template, ref, required))

    def validator(self, definition: str) -> jsonschema.Draft4Validator:
        schema = {"definitions": self.definitions, "$ref": f"#/definitions/{definition}"}
        return jsonschema.Draft4Validator(schema)

    def validate(self, definition: str, body: Any) -> None:
        """Raise `jsonschema.ValidationError` if `body` does not match `definition`."""
        self.validator(definition).validate(body)

    def errors(self, definition: str, body: Any) -> list[str]:
        return [e.message for e in self.validator(definition).iter_errors(body)]

    def operation(self, method: str, path: str) -> tuple[Operation, dict[str, str]] | None:
        for op in self.operations:
            if op.method != method:
                continue
            pattern = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(op.template))
            match = re.fullmatch(pattern, path)
            if match:
                return op, match.groupdict()
        return None


@cache
def load() -> Swagger:
    return Swagger(yaml.safe_load(SPEC_PATH.read_text()))
