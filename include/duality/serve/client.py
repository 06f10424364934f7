"""What `duality query` asks the replicas with: each configured replica's lag first, then the
row from the one with the least lag, the next on a 503 or no answer (docs/serving.md)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from duality.config import Settings
from duality.errors import CheckFailed, UsageError

# Seconds a replica may take to answer before the next is asked.
TIMEOUT_S = 2.0


def _get(settings: Settings, url: str, timeout: float) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of GET `url`; OSError when the replica does not answer."""
    request = urllib.request.Request(url)
    if settings.serve_token:
        request.add_header("Authorization", f"Bearer {settings.serve_token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        try:
            body = json.loads(error.read())
        except ValueError:
            body = {"error": f"HTTP {error.code}"}
        return error.code, body


def by_lag(settings: Settings, pipeline: str, timeout: float = TIMEOUT_S) -> list[str]:
    """The configured replicas, the one with the least lag on `pipeline` first; those that
    did not answer last, in their configured order."""
    lags: dict[str, float] = {}
    for url in settings.replica_urls:
        try:
            status, body = _get(settings, f"{url}/v1/pipelines/{_quote(pipeline)}", timeout)
        except OSError:
            status, body = 0, {}
        lags[url] = float(body["lag"]) if status == 200 else float("inf")
    return sorted(settings.replica_urls, key=lambda url: lags[url])


def query(
    settings: Settings,
    pipeline: str,
    key: str,
    *,
    max_lag: int | None = None,
    at: str | None = None,
    wait: float | None = None,
    timeout: float = TIMEOUT_S,
) -> dict[str, Any]:
    """The row of `key` with its position, from the first replica that can answer; 404 (no
    row) is CheckFailed with the position, 400 and 401 UsageError, and no replica answering
    CheckFailed naming each one's reason."""
    params = {
        name: value
        for name, value in (("max_lag", max_lag), ("at", at), ("wait", wait))
        if value is not None
    }
    path = f"/v1/pipelines/{_quote(pipeline)}/rows/{_quote(key)}"
    path += f"?{urllib.parse.urlencode(params)}" if params else ""
    reasons = []
    for url in by_lag(settings, pipeline, timeout):
        try:
            status, body = _get(settings, url + path, timeout + (wait or 0))
        except OSError as error:
            reasons.append(f"{url}: no answer ({getattr(error, 'reason', error)})")
            continue
        if status == 200:
            return {**body, "replica": url}
        if status == 404 and "position" in body:
            raise CheckFailed(
                f"{pipeline}: {body['error']} (replica {url})", {**body, "replica": url}
            )
        if status in (400, 401, 404):
            raise UsageError(f"{pipeline}: {body.get('error')} (replica {url})")
        reasons.append(f"{url}: {status} {body.get('error', '')}".rstrip())
    raise CheckFailed(
        f"no replica of {pipeline} answered: {'; '.join(reasons)}",
        {"pipeline": pipeline, "key": key, "replicas": reasons},
    )


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="")
