"""A burst of creates that wait for capacity, from the official e2b SDK (E2B_API_URL and
E2B_SANDBOX_URL set; the gateway's namespace): `burst.py WAIT LABEL=KEY:COUNT...` sends every
key's COUNT creates at once (all threads started together, the keys' in the order given), each
with `X-Aenv-Wait: WAIT` and the SDK's own retries off (a 429 is a failure, not a retry); each
sandbox, once its create answered, runs one command and is killed. Meanwhile each key polls
`GET /aenv/queue`. Prints one JSON line: the seconds to the last answer, each key's started,
failed (by message) and the rank of its last answer among all, the labels in the order the
creates were answered, and what the queue showed (most waiting, each key's furthest place)."""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from e2b import Sandbox

WAIT_HEADER = "X-Aenv-Wait"
POLL_S = 0.5


def one(label: str, key: str, wait: float, start: float) -> dict[str, Any]:
    try:
        sandbox = Sandbox.create(
            "base",
            timeout=600,
            metadata={"suite": "burst"},
            api_key=key,
            api_headers={WAIT_HEADER: str(wait)},
            request_timeout=wait + 120,
            retries=0,
        )
    except Exception as error:
        return {"label": label, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    answered = time.perf_counter() - start
    try:
        out = sandbox.commands.run("echo ran").stdout
    except Exception as error:
        out = f"{type(error).__name__}: {str(error)[:300]}"
    finally:
        sandbox.kill()
    return {"label": label, "answered": answered, "ran": out == "ran\n", "out": out}


def poll(keys: dict[str, str], stop: threading.Event, seen: dict[str, Any]) -> None:
    url = os.environ["E2B_API_URL"]
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.wait(POLL_S):
            for label, key in keys.items():
                try:
                    answer = http.get("/aenv/queue", headers={"X-API-Key": key})
                    queue = answer.json() if answer.status_code == 200 else None
                except (httpx.HTTPError, ValueError):
                    queue = None
                if queue is None:  # a poll past the key's rate limit, say
                    seen["poll_errors"] += 1
                    continue
                seen["polls"] += 1
                seen["most_waiting"] = max(seen["most_waiting"], queue["waiting"])
                places = [*queue["positions"]]
                furthest = max(places, default=0)
                seen["furthest_place"][label] = max(seen["furthest_place"][label], furthest)
                seen["most_at_key_limit"][label] = max(
                    seen["most_at_key_limit"][label], queue.get("keyLimitWaiting", 0)
                )


def main() -> None:
    wait = float(sys.argv[1])
    plan = []
    keys: dict[str, str] = {}
    for spec in sys.argv[2:]:
        label, rest = spec.split("=", 1)
        key, count = rest.rsplit(":", 1)
        keys[label] = key
        plan += [(label, key)] * int(count)
    seen: dict[str, Any] = {
        "polls": 0,
        "poll_errors": 0,
        "most_waiting": 0,
        "furthest_place": dict.fromkeys(keys, 0),
        "most_at_key_limit": dict.fromkeys(keys, 0),
    }
    stop = threading.Event()
    poller = threading.Thread(target=poll, args=(keys, stop, seen))
    poller.start()
    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(len(plan)) as pool:
            done = list(pool.map(lambda p: one(p[0], p[1], wait, start), plan))
    finally:
        stop.set()
        poller.join()
    answered = sorted((d for d in done if "answered" in d), key=lambda d: d["answered"])
    order = [d["label"] for d in answered]
    per_key = {}
    for label in keys:
        mine = [d for d in done if d["label"] == label]
        ranks = [i + 1 for i, other in enumerate(order) if other == label]
        per_key[label] = {
            "sent": len(mine),
            "started": sum("answered" in d for d in mine),
            "ran": sum(bool(d.get("ran")) for d in mine),
            "failed": collections.Counter(d["error"] for d in mine if "error" in d),
            "last_rank": max(ranks, default=0),
            "last_answer_s": round(max((d["answered"] for d in answered if d["label"] == label),
                                       default=0.0), 2),
        }  # fmt: skip
    not_ran = [d["out"] for d in done if "answered" in d and not d["ran"]][:5]
    print(
        json.dumps(
            {
                "seconds_to_last": round(answered[-1]["answered"], 2) if answered else None,
                "keys": per_key,
                "order": "".join(label[0] for label in order),
                "queue": seen,
                "commands_failed": not_ran,
            }
        )
    )


if __name__ == "__main__":
    main()
