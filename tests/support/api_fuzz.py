"""What schemathesis checks of every response the API fuzz tests get (tests/e2e/inner and
tests/api): no server error, and the status code, content type, headers and body as the
served OpenAPI document says."""

from __future__ import annotations

from schemathesis.checks import ignored_auth, not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    ignored_auth,
]
