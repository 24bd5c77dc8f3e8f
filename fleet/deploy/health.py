"""Is an instance serving? ``/health`` 200, ``/v1/models`` lists a model, and a 1-token completion
answers (vLLM's OpenAI-compatible server: ``vllm/entrypoints/openai/api_server.py``)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

HEALTH_TIMEOUT_S = 300.0
#: the waits between two polls of an instance that does not serve yet: doubling from the first to
#: the last, which then repeats (an instance that starts in a second is seen within ~0.1 s of
#: it; one that loads its model for minutes is asked once a second, as before)
POLL_FIRST_S, POLL_LAST_S = 0.1, 1.0


@dataclass
class Endpoint:
    unit: str
    url: str
    model: str
    healthy: bool = False
    detail: str = ""


def _call(url: str, key: str | None, body: dict[str, object] | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (urllib.error.URLError, OSError):
        return 0, b""


def probe_once(e: Endpoint, key: str | None) -> tuple[bool, str]:
    """One round of the three checks: (serving?, what was seen)."""
    status, _ = _call(e.url + "/health", key)
    if status != 200:
        return False, f"/health {status or 'refused'}"
    status, body = _call(e.url + "/v1/models", key)
    try:
        ids = [str(m.get("id")) for m in json.loads(body or b"{}").get("data", [])]
    except (ValueError, AttributeError):
        ids = []
    if status != 200 or not ids:
        return False, f"/v1/models {status or 'refused'} lists no model"
    status, body = _call(e.url + "/v1/completions", key, {"model": ids[0], "prompt": "ping", "max_tokens": 1})
    if status != 200:
        return False, f"/v1/completions {status or 'refused'}"
    return True, "serving " + ", ".join(ids)


def poll_waits() -> Iterator[float]:
    """The waits between polls: :data:`POLL_FIRST_S`, doubling, then :data:`POLL_LAST_S` for ever."""
    wait = POLL_FIRST_S
    while True:
        yield wait
        wait = min(wait * 2, POLL_LAST_S)


def wait_healthy(endpoints: list[Endpoint], key: str | None, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """Poll each endpoint until it passes :func:`probe_once`, or time out (``healthy`` stays False);
    between two polls :data:`POLL_FIRST_S` doubling up to :data:`POLL_LAST_S`."""
    deadline = time.monotonic() + timeout
    for e in endpoints:
        waits = poll_waits()
        while True:
            ok, seen = probe_once(e, key)
            if ok:
                e.healthy, e.detail = True, seen
                break
            if time.monotonic() > deadline:
                e.healthy, e.detail = False, f"not serving within {timeout:.0f} s (last: {seen})"
                break
            time.sleep(next(waits))
