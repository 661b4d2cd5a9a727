"""What schemathesis checks of every response the API fuzz tests get (tests/e2e/inner and
tests/api): no server error but the one documented 507, and the status code, content type,
headers and body as the served OpenAPI document says."""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis.checks import ignored_auth, not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

# A volume larger than the host's free disk is refused with 507 (documented for POST
# /volumes): the fuzzer's sizes reach it on any disk, so the answer is right, not a fault.
DOCUMENTED_SERVER_ERRORS = {507}


@schemathesis.check
def no_undocumented_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """`not_a_server_error`, but for a status of DOCUMENTED_SERVER_ERRORS that the document
    lists for the operation."""
    documented = {str(code) for code in case.operation.responses.status_codes}
    if response.status_code in DOCUMENTED_SERVER_ERRORS and str(response.status_code) in documented:
        return None
    result: bool | None = not_a_server_error(ctx, response, case)
    return result


CHECKS = [
    no_undocumented_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    ignored_auth,
]
