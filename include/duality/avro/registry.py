"""A client of a schema registry's Confluent API (`DUALITY_SCHEMA_REGISTRY_URL`): subjects'
versions, schemas by id, registration. Errors name the setting; the basic-auth password is sent,
never shown."""

from __future__ import annotations

import base64
import dataclasses
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from duality.config import PREFIX, Settings
from duality.errors import UsageError

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
TIMEOUT_S = 10.0


class RegistryError(UsageError):
    """The registry cannot be reached, or refused a request."""


class NotFound(RegistryError):
    """The registry has no such subject, version or schema id."""


@dataclasses.dataclass(frozen=True)
class Version:
    subject: str
    version: int
    id: int
    schema: dict[str, Any]  # the Avro schema, parsed


def authorization(settings: Settings) -> str | None:
    """The Authorization header's value for the settings' basic-auth user, or None."""
    if settings.schema_registry_user is None or settings.schema_registry_password is None:
        return None
    pair = f"{settings.schema_registry_user}:{settings.schema_registry_password}"
    return "Basic " + base64.b64encode(pair.encode()).decode()


def registry_url(settings: Settings) -> str:
    if not settings.schema_registry_url:
        raise UsageError(
            f"an Avro source reads its schemas from a schema registry: set "
            f"{PREFIX}SCHEMA_REGISTRY_URL (`duality up --schema-registry` starts one)"
        )
    return settings.schema_registry_url.rstrip("/")


class Registry:
    """The settings' schema registry."""

    def __init__(self, settings: Settings, timeout: float = TIMEOUT_S):
        self.url = registry_url(settings)
        self._authorization = authorization(settings)
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Accept", CONTENT_TYPE)
        if data is not None:
            request.add_header("Content-Type", CONTENT_TYPE)
        if self._authorization is not None:
            request.add_header("Authorization", self._authorization)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                return json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:300]
            if error.code == 404:
                raise NotFound(
                    f"the schema registry at {self.url} has no {path}: {detail}"
                ) from None
            if error.code in (401, 403):
                raise RegistryError(
                    f"the schema registry at {self.url} ({PREFIX}SCHEMA_REGISTRY_URL) refused "
                    f"duality's credentials (HTTP {error.code}): check "
                    f"{PREFIX}SCHEMA_REGISTRY_USER and {PREFIX}SCHEMA_REGISTRY_PASSWORD"
                ) from None
            raise RegistryError(
                f"the schema registry at {self.url} ({PREFIX}SCHEMA_REGISTRY_URL) answered "
                f"{method} {path} with HTTP {error.code}: {detail}"
            ) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise RegistryError(
                f"cannot reach the schema registry at {self.url} "
                f"({PREFIX}SCHEMA_REGISTRY_URL): {reason}"
            ) from None

    @staticmethod
    def _quoted(subject: str) -> str:
        return urllib.parse.quote(subject, safe="")

    def versions(self, subject: str) -> list[int]:
        """The subject's version numbers, oldest first."""
        try:
            return sorted(
                int(v) for v in self._call("GET", f"/subjects/{self._quoted(subject)}/versions")
            )
        except NotFound:
            raise NotFound(
                f"the schema registry at {self.url} has no subject {subject!r}: register the "
                "topic's value schema first, or name the subject in the spec (source.subject)"
            ) from None

    def version(self, subject: str, version: int | str = "latest") -> Version:
        answer = self._call("GET", f"/subjects/{self._quoted(subject)}/versions/{version}")
        if answer.get("schemaType", "AVRO") != "AVRO":
            raise RegistryError(
                f"subject {subject!r} version {answer.get('version')} is {answer['schemaType']}, "
                "not Avro"
            )
        return Version(
            subject, int(answer["version"]), int(answer["id"]), json.loads(answer["schema"])
        )

    def schema(self, schema_id: int) -> dict[str, Any]:
        answer = self._call("GET", f"/schemas/ids/{schema_id}")
        parsed: dict[str, Any] = json.loads(answer["schema"])
        return parsed

    def register(self, subject: str, schema: dict[str, Any]) -> int:
        """Register `schema` under `subject` (the registry's compatibility rules apply); its id."""
        answer = self._call(
            "POST", f"/subjects/{self._quoted(subject)}/versions", {"schema": json.dumps(schema)}
        )
        return int(answer["id"])
