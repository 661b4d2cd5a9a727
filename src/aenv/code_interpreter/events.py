"""The lines of the `/execute` NDJSON stream, as the SDKs parse them.

Each line is one JSON object with a `type`: `stdout`/`stderr` (`text`, `timestamp` in Unix
nanoseconds), `result` (one field per format, `data` and `chart`, `is_main_result`, unknown
formats in `extra`), `error` (`name`, `value`, `traceback`), `number_of_executions`
(`execution_count`) and a final `end_of_execution`.

A result's `text` is its plain text as E2B's server gives it: a string's repr without its
quotes (`bar` for `'bar'`), whatever the language.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

# Jupyter MIME types and the Result field each fills; any other type goes to `extra`.
FORMATS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}
# What the kernel start-up code (`startup`) gives dataframes: their columns as JSON.
DATA_MIME = "application/vnd.aenv.data+json"
# And matplotlib figures: their chart (`charts`).
CHART_MIME = "application/vnd.aenv.chart+json"
# The metadata key of a display that is the cell's own value: tslab shows that as a display
# (`tslab_kernel.js`), ipykernel and the others as an `execute_result`.
MAIN_RESULT = "aenv/main_result"

Event = dict[str, Any]


def line(event: Event) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


def stream(name: str, text: str) -> Event:
    return {"type": name, "text": text, "timestamp": time.time_ns()}


def result(bundle: Mapping[str, Any], main: bool) -> Event:
    event: Event = {"type": "result", "is_main_result": main}
    extra = {}
    for mime, value in bundle.items():
        if mime == "text/plain" and isinstance(value, str):
            event["text"] = _unquoted(value)
        elif mime in FORMATS:
            event[FORMATS[mime]] = value
        elif mime == DATA_MIME:
            event["data"] = value
        elif mime == CHART_MIME:
            event["chart"] = value
        else:
            extra[mime] = value
    if extra:
        event["extra"] = extra
    return event


def _unquoted(text: str) -> str:
    if len(text) >= 1 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def error(name: str, value: str, traceback: list[str]) -> Event:
    return {"type": "error", "name": name, "value": value, "traceback": "\n".join(traceback)}


def count(execution_count: int) -> Event:
    return {"type": "number_of_executions", "execution_count": execution_count}


END: Event = {"type": "end_of_execution"}
