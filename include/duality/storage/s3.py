"""The few requests to the S3 API duality makes itself, signed with AWS Signature Version 4:
a bucket's check and creation, and an object created only if absent (`If-None-Match: *`), which
pyarrow's client cannot send. Spark reaches the store through Hadoop's S3A, delta-rs through its
own client, everything else through pyarrow (`duality.storage.objects`)."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import http.client
import urllib.parse
from collections.abc import Mapping

from duality.errors import UsageError
from duality.storage.objects import Store

# The setting's name, as errors give them (duality.config.PREFIX; config imports this package).
ENDPOINT = "DUALITY_S3_ENDPOINT"
# How long a check waits for the endpoint to answer each request, and a write.
CHECK_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 60.0


def split(location: str) -> tuple[str, str]:
    """`s3a://bucket/some/prefix` -> (`bucket`, `some/prefix`)."""
    rest = location.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    return bucket, key.strip("/")


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    reason: str
    body: bytes
    headers: Mapping[str, str]


class Unreachable(UsageError):
    """The endpoint did not answer (refused, timed out, no such host)."""


class ConditionRefused(UsageError):
    """The server does not take a conditional write (`If-None-Match: *`): it cannot create an
    object only if absent."""


def _endpoint(store: Store) -> urllib.parse.SplitResult:
    if not store.endpoint:
        raise UsageError(
            f"{ENDPOINT} is not set, and a location is on object storage: set it to the "
            "S3 API's URL (http://host:port; `duality up --object-store` starts a local one), "
            "or give local paths"
        )
    return urllib.parse.urlsplit(store.endpoint)


def request(
    store: Store,
    method: str,
    path: str,
    *,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    query: Mapping[str, str] | None = None,
    timeout: float = CHECK_TIMEOUT_S,
) -> Answer:
    """One signed request to the endpoint (`path` is `/bucket[/key]`). An endpoint that does not
    answer: Unreachable, naming the setting (never the secret)."""
    url = _endpoint(store)
    secret = store.secret()
    host = url.netloc
    canonical_path = urllib.parse.quote(path, safe="/-_.~")
    canonical_query = "&".join(
        f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
        for k, v in sorted((query or {}).items())
    )
    now = datetime.datetime.now(datetime.UTC)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(body).hexdigest()
    sent = {"host": host, "x-amz-date": stamp, "x-amz-content-sha256": payload}
    sent |= {k.lower(): v for k, v in (headers or {}).items()}
    if store.access_key and secret:
        names = sorted(sent)
        canonical = "\n".join(
            [
                method,
                canonical_path,
                canonical_query,
                "".join(f"{n}:{sent[n].strip()}\n" for n in names),
                ";".join(names),
                payload,
            ]
        )
        scope = f"{day}/{store.region}/s3/aws4_request"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        key = f"AWS4{secret}".encode()
        for part in (day, store.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        sent["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={store.access_key}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature}"
        )
    kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    connection = kind(host, timeout=timeout)
    target = canonical_path + (f"?{canonical_query}" if canonical_query else "")
    try:
        connection.request(method, target, body=body or None, headers=sent)
        answer = connection.getresponse()
        return Answer(answer.status, answer.reason, answer.read(), dict(answer.getheaders()))
    except OSError as error:
        reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
        raise Unreachable(
            f"the object store at {ENDPOINT}={store.endpoint} does not answer "
            f"({reason}): start it (`duality up --object-store` runs a local one) or correct "
            f"{ENDPOINT}"
        ) from None
    finally:
        connection.close()


def error_code(answer: Answer) -> str:
    text = answer.body.decode(errors="replace")
    start = text.find("<Code>")
    if start < 0:
        return answer.reason
    return text[start + 6 : text.find("</Code>", start)]


def create_if_absent(store: Store, location: str, body: bytes) -> bool:
    """Write the object at `location` (`s3a://bucket/key`) only if none is there: one PUT with
    `If-None-Match: *`, which the server refuses (412) when another writer created it first.
    Whether this call created it. (A server that ignored the condition would answer 200 to
    both: the integration test checks the local one refuses the second.)"""
    bucket, key = split(location)
    # A first write may wait for the server to grow a volume for the bucket (9 s here).
    answer = request(
        store,
        "PUT",
        f"/{bucket}/{key}",
        body=body,
        headers={"If-None-Match": "*"},
        timeout=WRITE_TIMEOUT_S,
    )
    if answer.status == 200:
        return True
    if answer.status in (409, 412):
        return False
    if answer.status == 501 or error_code(answer) == "NotImplemented":
        raise ConditionRefused(
            f"the object store at {ENDPOINT}={store.endpoint} does not take a conditional "
            f"write (If-None-Match: *) of {location}: HTTP {answer.status} "
            f"({error_code(answer)})"
        )
    raise UsageError(
        f"the object store at {ENDPOINT}={store.endpoint} refused to write "
        f"{location}: HTTP {answer.status} ({error_code(answer)})"
    )
