"""One request to a running `megatron-hpc serve`: Megatron's `PUT /api` with a JSON body.

The CLI client (`serve --client`), the latency benchmark and the SLURM serving test all speak to the server
through this, so they measure and check the same round trip a user's client makes.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.error import HTTPError
from urllib.request import Request, urlopen


def put_api(url: str, body: dict[str, Any], *, timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
    """PUT `body` as JSON to `url`; (HTTP status, decoded JSON reply). A refusal (4xx/5xx) is returned, not raised,
    because its JSON carries the reason; an unreachable server raises urllib's URLError."""
    req = Request(url, data=json.dumps(body).encode(), method="PUT", headers={"Content-Type": "application/json"})
    try:
        with urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except HTTPError as exc:
        raw = exc.read()
        try:
            reply = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            # Not the API's JSON: most often the 404 page of a URL without /api (Megatron's own client takes
            # HOST:PORT and adds it). The page itself is many lines of HTML; its reason and the fix are one.
            hint = "; is the URL http://HOST:PORT/api?" if exc.code in (404, 405) else ""
            reply = {"message": f"{exc.reason}, not an answer of Megatron's API{hint}"}
        return exc.code, reply if isinstance(reply, dict) else {"message": str(reply)}
