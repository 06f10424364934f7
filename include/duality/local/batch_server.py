"""The batch server of the local stack (`duality batch-server`, `duality.batch_server`): the warm
Spark that batch steps run on (docs/decisions/0026-warm-spark-for-batch-steps.md), with the
shared secret and the self-signed TLS certificate it makes for it
(docs/decisions/0034-an-authenticated-batch-server.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import ipaddress
import json
import os
import secrets
import shutil
import sys
from pathlib import Path

from duality.batch_server import Refused, server_report
from duality.config import PREFIX, Settings
from duality.errors import DualityError, LocalStackError, UsageError
from duality.local.ports import LOCAL_HOSTS, free_port
from duality.local.startup import wait_started
from duality.process import live_pid, start_daemon, stop_group

# The server's Spark log: warnings and errors only (Spark logs every task).
_LOGGING = """\
rootLogger.level = warn
rootLogger.appenderRef.console.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
"""


@dataclasses.dataclass(frozen=True)
class BatchServerStatus:
    state: str  # running, stopped
    address: str | None  # what DUALITY_BATCH_SERVER is set to, 127.0.0.1:<port>
    pid: int | None
    master: str | None
    log: Path
    steps: list[str] | None = None  # the commands it runs; None when it does not answer
    already_running: bool | None = None  # set by `start()`


@dataclasses.dataclass(frozen=True)
class BatchServerStopped:
    was_running: bool
    pid: int | None


class LocalBatchServer:
    """One server in `root` (default `<local_dir>/batch-server`), on the loopback address, the
    driver of an application on `settings.spark_master` (local mode or the standalone cluster)."""

    def __init__(self, settings: Settings, *, root: Path | None = None):
        self.settings = settings
        self.root = root if root is not None else settings.local_dir / "batch-server"
        self.state_file = self.root / "server.json"
        self.pid_file = self.root / "server.pid"
        self.log = self.root / "server.log"
        # Made by `start` when the settings name none; 0600, kept across `down` and `up`.
        self.secret_file = self.root / "secret"
        self.tls_cert = self.root / "tls" / "server.crt"
        self.tls_key = self.root / "tls" / "server.key"

    def pid(self) -> int | None:
        if not self.state_file.is_file():
            return None
        port = json.loads(self.state_file.read_text())["port"]
        return live_pid(
            self.pid_file, lambda cmdline: "batch-server" in cmdline and str(port) in cmdline
        )

    @property
    def address(self) -> str:
        if not self.state_file.is_file():
            raise LocalStackError(f"the batch server in {self.root} is not running")
        return f"127.0.0.1:{json.loads(self.state_file.read_text())['port']}"

    def client_settings(self) -> dict[str, object]:
        """The settings (Settings fields) that reach this server: its address, and the secret
        file and certificate it made (none of them when the settings name their own)."""
        changes: dict[str, object] = {"batch_server": self.address}
        if self._own_secret():
            changes["batch_server_secret_file"] = self.secret_file
        if self._own_tls():
            changes["batch_server_tls_cert"] = self.tls_cert
        return changes

    def _own_secret(self) -> bool:
        """Whether the server uses the secret file it makes (the settings name no other)."""
        return self.settings.batch_server_secret is None and (
            self.settings.batch_server_secret_file in (None, self.secret_file)
        )

    def _own_tls(self) -> bool:
        return self.settings.batch_server_tls_cert in (None, self.tls_cert)

    def credentials(self) -> dict[str, str]:
        """The server's secret and certificate settings: those the settings name, else a
        secret file and a self-signed certificate made here once (0600 files)."""
        chosen: dict[str, str] = {}
        if self._own_secret():
            if not self.secret_file.is_file():
                _private_file(self.secret_file, secrets.token_urlsafe(32) + "\n")
            chosen[f"{PREFIX}BATCH_SERVER_SECRET_FILE"] = str(self.secret_file)
        if self._own_tls():
            if not (self.tls_cert.is_file() and self.tls_key.is_file()):
                self_signed_certificate(self.tls_cert, self.tls_key)
            chosen[f"{PREFIX}BATCH_SERVER_TLS_CERT"] = str(self.tls_cert)
            chosen[f"{PREFIX}BATCH_SERVER_TLS_KEY"] = str(self.tls_key)
        return chosen

    def _client(self) -> Settings:
        return self.settings.replace(**self.client_settings())

    def status(self) -> BatchServerStatus:
        pid = self.pid()
        if pid is None:
            return BatchServerStatus("stopped", None, None, None, self.log)
        steps = None
        # Still starting, or stopping; or its secret or certificate are not this one's.
        with contextlib.suppress(OSError, ValueError, DualityError):
            report = server_report(self._client(), timeout=2.0)
            steps = [step["command"] for step in report["steps"]]
        master = json.loads(self.state_file.read_text())["master"]
        return BatchServerStatus("running", self.address, pid, master, self.log, steps)

    def _port(self) -> int:
        """The port it last ran on (clients know it), else the one `settings.batch_server` names
        on this machine, else a free one."""
        if self.state_file.is_file():
            return int(json.loads(self.state_file.read_text())["port"])
        host, _, port = (self.settings.batch_server or "").rpartition(":")
        if host in LOCAL_HOSTS and port.isdigit():
            return int(port)
        return free_port()

    def start(self, timeout: float = 600.0) -> BatchServerStatus:
        """Start the server unless it runs; wait until it takes steps (its Spark started and
        warmed). A server that exits fails at once; the deadline is for one that hangs: on a
        busy machine, the first job of a cluster's executors, which start cold, took over 180 s
        (a CI run with three stacks starting side by side on two cores)."""
        if self.pid() is not None:
            return dataclasses.replace(self.status(), already_running=True)
        if shutil.which("java") is None:
            raise LocalStackError("java is not on PATH: install Java 17 and try again")
        port = self._port()
        self.root.mkdir(parents=True, exist_ok=True)
        credentials = self.credentials()
        master = self.settings.spark_master
        self.state_file.write_text(json.dumps({"port": port, "master": master}))
        (self.root / "log4j2.properties").write_text(_LOGGING)
        command = [sys.executable, "-m", "duality.cli", "batch-server"]
        command += ["--host", "127.0.0.1", "--port", str(port)]
        # Its log4j2.properties, named to its driver's JVM, and pyspark's own configuration
        # folder, nothing of the caller's: the driver's class path is then the one its class
        # archive was made with (decision 31), which a folder of its own would not be.
        logging = f"-Dlog4j2.configurationFile={self.root / 'log4j2.properties'}"
        environment = {
            **self.settings.process_env(),
            **credentials,
            "SPARK_SUBMIT_OPTS": f"{os.environ.get('SPARK_SUBMIT_OPTS', '')} {logging}".strip(),
        }
        environment.pop("SPARK_CONF_DIR", None)
        environment.pop(f"{PREFIX}BATCH_SERVER", None)
        process = start_daemon(command, self.log, self.pid_file, cwd=self.root, env=environment)
        wait_started(
            {"the batch server": process},
            [self.log],
            lambda: _answers(self._client()),
            failure=f"the batch server did not take steps on port {port}",
            timeout=timeout,
            stop=self.stop,
        )
        return dataclasses.replace(self.status(), already_running=False)

    def stop(self) -> BatchServerStopped:
        """Stop the server (its steps are interrupted) and its Spark; idempotent."""
        pid = self.pid()
        if pid is not None:
            stop_group(pid, 30.0)
        self.pid_file.unlink(missing_ok=True)
        self.state_file.unlink(missing_ok=True)
        return BatchServerStopped(pid is not None, pid)


def _answers(client: Settings) -> bool:
    """Whether the server takes steps (it listens only once its Spark is warm): it answers a
    status request with this secret, over TLS with this certificate. Refused: an error at once."""
    try:
        server_report(client, timeout=5.0)
        return True
    except Refused as error:
        raise LocalStackError(f"the batch server started, but {error}") from None
    except (UsageError, OSError):
        return False  # not listening yet


def _private_file(path: Path, text: str) -> None:
    """`path` holding `text`, readable by its owner only from its creation."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(text)


def self_signed_certificate(
    cert: Path, key: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")
) -> None:
    """A self-signed certificate for `hosts` (names and addresses), valid ten years, and its
    private key (P-256, a 0600 file): what the local stack's batch server presents and its
    clients trust."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "duality batch server")])
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    public = private.public_key()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(private, hashes.SHA256())
    )
    _private_file(
        key,
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode(),
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
