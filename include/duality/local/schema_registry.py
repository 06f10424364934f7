"""The local stack's schema registry (`duality up --schema-registry`, docs/streams.md#formats):
Apicurio Registry 3.0.9, the last release that runs on Java 17, fetched from Maven Central into
the jar cache once, run from `<local_dir>/schema-registry/` on the loopback address; its
Confluent-compatible API is what Avro sources read (decision 38). Its schemas are kept in an H2
file under that folder (Apicurio's default is in memory), so that a restart keeps their ids."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tarfile
from pathlib import Path

from duality import maven
from duality.config import PREFIX, Settings
from duality.errors import LocalStackError, UsageError
from duality.local.ports import free_port, port_in_use
from duality.local.startup import answers_ok, wait_started
from duality.process import live_pid, start_daemon, stop_group

VERSION = "3.0.9"
ARTIFACT = f"io.apicurio:apicurio-registry-app:{VERSION}:tar.gz:all"
RUNNER = f"apicurio-registry-app-{VERSION}-runner.jar"
# The path of the Confluent Schema Registry API on Apicurio.
CONFLUENT_API = "/apis/ccompat/v7"


@dataclasses.dataclass(frozen=True)
class RegistryStatus:
    state: str  # running or stopped
    url: str | None  # the Confluent API's URL
    pid: int | None
    ready: bool
    log: Path
    already_running: bool = False


def fetch(jar_cache: Path) -> Path:
    """Apicurio's runner jar in `<jar_cache>/schema-registry`, fetched and unpacked the first
    time (Maven's `dependency:copy`; its parent POM is not on Maven Central, so a project's
    `dependency:unpack`, which reads it, fails)."""
    folder = jar_cache / "schema-registry" / VERSION
    runner = folder / RUNNER
    if runner.is_file():
        return runner
    download = folder.with_name(f"{VERSION}.download")
    shutil.rmtree(download, ignore_errors=True)
    download.mkdir(parents=True)
    try:
        maven.copy(ARTIFACT, download)
    except LocalStackError:
        shutil.rmtree(download, ignore_errors=True)
        raise
    archives = list(download.glob("*.tar.gz"))
    if len(archives) != 1:
        shutil.rmtree(download, ignore_errors=True)
        raise LocalStackError(f"{ARTIFACT} from Maven Central is not one archive: {archives}")
    with tarfile.open(archives[0]) as archive:
        archive.extractall(download, filter="data")
    archives[0].unlink()
    if not (download / RUNNER).is_file():
        raise LocalStackError(f"{ARTIFACT} holds no {RUNNER}")
    shutil.rmtree(folder, ignore_errors=True)
    download.rename(folder)
    return runner


class LocalSchemaRegistry:
    """Apicurio Registry in `root` (default `<local_dir>/schema-registry`): its port (kept on
    file, so that started again it answers where its clients look), pid file and log. 3.0.9
    answers its health checks on that port too, and opens no other."""

    def __init__(self, settings: Settings, *, root: Path | None = None):
        self.settings = settings
        self.root = root if root is not None else settings.local_dir / "schema-registry"
        self.state_file = self.root / "server.json"
        self.pid_file = self.root / "registry.pid"
        self.log = self.root / "registry.log"

    def _port(self) -> int | None:
        if not self.state_file.is_file():
            return None
        return int(json.loads(self.state_file.read_text())["port"])

    def url(self) -> str | None:
        port = self._port()
        return f"http://127.0.0.1:{port}{CONFLUENT_API}" if port else None

    def client_settings(self) -> dict[str, str]:
        """The settings by which Avro sources find it."""
        url = self.url()
        return {f"{PREFIX}SCHEMA_REGISTRY_URL": url} if url else {}

    def pid(self) -> int | None:
        port = self._port()
        if port is None:
            return None
        flag = f"-Dquarkus.http.port={port}"
        return live_pid(
            self.pid_file, lambda cmdline: RUNNER in " ".join(cmdline) and flag in cmdline
        )

    def _ready(self) -> bool:
        port = self._port()
        return port is not None and answers_ok(f"http://127.0.0.1:{port}/health/ready")

    def status(self) -> RegistryStatus:
        pid = self.pid()
        if pid is None:
            return RegistryStatus("stopped", None, None, False, self.log)
        return RegistryStatus("running", self.url(), pid, self._ready(), self.log)

    def start(self, timeout: float = 300.0) -> RegistryStatus:
        """Start it unless it runs (fetching it first if need be); wait until it is ready."""
        if self.pid() is not None:
            return dataclasses.replace(self.status(), already_running=True)
        runner = fetch(self.settings.jar_cache)
        java = shutil.which("java")
        if java is None:
            raise UsageError("java is not installed: install Java 17")
        port = self._port()
        if port is None or port_in_use("127.0.0.1", port):
            port = free_port()
        self.root.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps({"port": port}))
        command = [
            java,
            "-Xmx256m",
            f"-Djava.io.tmpdir={self.root}",
            "-Dquarkus.http.host=127.0.0.1",
            f"-Dquarkus.http.port={port}",
            f"-Dapicurio.datasource.url=jdbc:h2:file:{self.root / 'data' / 'registry'}",
            f"-Dapicurio.storage.snapshot.location={self.root}",
            "-jar",
            str(runner),
        ]
        process = start_daemon(command, self.log, self.pid_file, cwd=self.root)
        wait_started(
            {"Apicurio Registry": process},
            [self.log],
            self._ready,
            failure=f"the schema registry did not answer /health/ready on port {port}",
            timeout=timeout,
            stop=self.stop,
        )
        return self.status()

    def stop(self) -> int | None:
        """Stop it if it runs; its pid, or None."""
        pid = self.pid()
        if pid is not None:
            stop_group(pid, 30.0)
        # The ports stay on file: started again, it answers where its clients look.
        self.pid_file.unlink(missing_ok=True)
        return pid
