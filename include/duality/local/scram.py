"""SCRAM-SHA-512 logins of a local broker or cluster: its users, and their salted passwords."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
from collections.abc import Mapping

from duality.config import Settings
from duality.errors import UsageError

SCRAM_MECHANISM = "SCRAM-SHA-512"
# The user the nodes of a SCRAM broker or cluster log in as to each other.
BROKER_USER = "duality-broker"
_SCRAM_ITERATIONS = 4096
_SCRAM_USER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._@-")


@dataclasses.dataclass(frozen=True)
class Scram:
    """Users (name -> password) of a local broker (docs/decisions/0014-sasl-scram.md); with
    `acls`, what no ACL allows is denied, except to `super_users` and the nodes."""

    users: Mapping[str, str] = dataclasses.field(repr=False)
    acls: bool = False
    super_users: tuple[str, ...] = ()
    broker_password: str = dataclasses.field(
        default_factory=lambda: base64.urlsafe_b64encode(os.urandom(24)).decode(), repr=False
    )

    def __post_init__(self) -> None:
        for name in [*self.users, *self.super_users]:
            if not name or not set(name) <= _SCRAM_USER_CHARS or name == BROKER_USER:
                raise UsageError(
                    f"SCRAM user name {name!r} of the local broker: use letters, digits and "
                    f"'._@-' only, and not {BROKER_USER!r}"
                )
        for name, password in self.users.items():
            if not password:
                raise UsageError(f"SCRAM user {name!r} of the local broker needs a password")

    @classmethod
    def from_settings(cls, settings: Settings) -> Scram:
        """The one login `settings` name, for a local broker they will reach (`duality up`)."""
        if (
            settings.security_protocol != "SASL_PLAINTEXT"
            or settings.sasl_mechanism != SCRAM_MECHANISM
            or not settings.sasl_username
            or not settings.sasl_password
        ):
            raise UsageError(
                "a local broker with SCRAM logins needs DUALITY_SECURITY_PROTOCOL=SASL_PLAINTEXT, "
                f"DUALITY_SASL_MECHANISM={SCRAM_MECHANISM}, DUALITY_SASL_USERNAME and "
                "DUALITY_SASL_PASSWORD: set them"
            )
        return cls({settings.sasl_username: settings.sasl_password})

    def login(self, settings: Settings, user: str) -> Settings:
        """`settings` that log in as `user` (one of `users`)."""
        return settings.replace(
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism=SCRAM_MECHANISM,
            sasl_username=user,
            sasl_password=self.users[user],
        )


def scram_argument(user: str, password: str) -> str:
    """StorageTool's `--add-scram` value, salted (RFC 5802's Hi()): no password on command lines."""
    salt = os.urandom(32)
    salted = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, _SCRAM_ITERATIONS)
    encode = base64.b64encode
    return (
        f"{SCRAM_MECHANISM}=[name={user},salt={encode(salt).decode()},"
        f"saltedpassword={encode(salted).decode()},iterations={_SCRAM_ITERATIONS}]"
    )
