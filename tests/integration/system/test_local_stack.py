"""`duality up | status | down` as a user runs them, on free ports in a temporary folder."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import psutil

from duality.config import Settings
from duality.local.ports import free_port
from tests.harness import UP_TIMEOUT_S, duality_json, ended_pid, run_duality


def _kafka_processes(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "kafka.Kafka" in cmdline and any(marker in part for part in cmdline):
            found.append(process)
    return found


def _monitoring_processes(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if cmdline and "prometheus" in cmdline[0] and any(marker in part for part in cmdline):
            found.append(process)
    return found


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_up_twice_status_down(tmp_path: Path):
    port = free_port()
    env = Settings.from_env().replace(
        local_dir=tmp_path / "local",
        bootstrap_servers=f"localhost:{port}",
        controller_port=free_port(),
        airflow_url=f"http://localhost:{free_port()}",
    )
    try:
        first = duality_json(env, "up", "--monitoring", "--object-store", timeout=UP_TIMEOUT_S)
        started = first["broker"]
        assert started["already_running"] is False
        watching = first["monitoring"]
        assert watching["already_running"] is False
        record = json.loads((tmp_path / "local" / "stack.json").read_text())
        assert record["settings"]["DUALITY_PUSHGATEWAY"] == watching["pushgateway"]["address"]
        prometheus_url = f"http://{watching['prometheus']['address']}"
        assert record["settings"]["DUALITY_PROMETHEUS_URL"] == prometheus_url
        # The replicas of the pipelines' tables answer where `duality query` will ask.
        serving = first["serving"]
        assert serving["already_running"] is False and serving["healthy"] is True
        assert record["settings"]["DUALITY_REPLICAS"] == serving["url"]
        # The S3 server (docs/operations.md "Object storage"), its bucket made, its endpoint,
        # key and secret's file (a private one) in the record, never the secret.
        store = first["object_store"]
        assert (store["state"], store["ready"]) == ("running", True)
        assert store["already_running"] is False
        assert record["settings"]["DUALITY_S3_ENDPOINT"] == store["endpoint"]
        s3_secret = Path(record["settings"]["DUALITY_S3_SECRET_KEY_FILE"])
        assert s3_secret.stat().st_mode & 0o777 == 0o600
        assert "DUALITY_S3_SECRET_KEY" not in record["settings"]

        # A second `up` keeps what runs, monitoring included.
        second = duality_json(env, "up")
        again = second["broker"]
        assert again["already_running"] is True
        assert again["pid"] == started["pid"]
        assert second["monitoring"]["already_running"] is True
        assert second["serving"]["already_running"] is True
        assert second["serving"]["pid"] == serving["pid"]
        assert second["object_store"]["already_running"] is True
        assert second["object_store"]["pid"] == store["pid"]
        # The tables, checkpoints and reports are in its bucket, and stay there when `up` runs
        # again (its environment does not name them).
        recorded = json.loads((tmp_path / "local" / "stack.json").read_text())["settings"]
        for name, folder in (("WAREHOUSE", "warehouse"), ("CHECKPOINT_ROOT", "checkpoints")):
            assert recorded[f"DUALITY_{name}"] == f"s3a://duality/{folder}", recorded
        assert len(_monitoring_processes(str(tmp_path))) == 2
        assert len(_kafka_processes(str(tmp_path))) == 1
        # The broker's JVM unpacks its native libraries into its own folder, not /tmp.
        (broker_jvm,) = _kafka_processes(str(tmp_path))
        assert f"-Djava.io.tmpdir={tmp_path / 'local' / 'kafka' / 'tmp'}" in broker_jvm.cmdline()

        status = duality_json(env, "status")
        for program in ("prometheus", "pushgateway"):
            shown = status["monitoring"][program]
            assert (shown["state"], shown["ready"]) == ("running", True), program
            assert shown["pid"] == watching[program]["pid"], program
        broker = status["broker"]
        assert broker["state"] == "running"
        assert broker["reachable"] is True
        assert broker["bootstrap_servers"] == f"localhost:{port}"
        # The broker logs through log4j: a missing SLF4J binding once left the file empty.
        assert "Kafka Server started" in Path(broker["log"]).read_text()
        # The batch server's secret and self-signed certificate, made by `up` as private files
        # and named in the record; `status` asked the server over TLS with them (decision 34).
        own = tmp_path / "local" / "batch-server"
        assert record["settings"]["DUALITY_BATCH_SERVER_SECRET_FILE"] == str(own / "secret")
        certificate = str(own / "tls" / "server.crt")
        assert record["settings"]["DUALITY_BATCH_SERVER_TLS_CERT"] == certificate
        for private in (own / "secret", own / "tls" / "server.key"):
            assert private.stat().st_mode & 0o777 == 0o600, private
        assert status["batch"]["state"] == "running" and status["batch"]["steps"] == []
        assert (status["serving"]["state"], status["serving"]["url"]) == ("running", serving["url"])
        assert (status["object_store"]["state"], status["object_store"]["pid"]) == (
            "running",
            store["pid"],
        )
        assert s3_secret.read_text().strip() not in json.dumps([first, second, status])
        secret = (own / "secret").read_text().strip()
        assert secret not in json.dumps([first, second, status])
        for path in (tmp_path / "local").rglob("*"):
            if path.is_file() and path != own / "secret" and path.stat().st_size < 50_000_000:
                assert secret.encode() not in path.read_bytes(), path
        # A JVM folder that a killed driver left (its process has ended).
        left = tmp_path / "local" / "jvm-tmp" / f"{socket.gethostname()}-{ended_pid()}"
        (left / "blockmgr-1").mkdir(parents=True)
    finally:
        down = run_duality(env, "down", "--json")
    assert down.returncode == 0, down.stderr
    assert [node["pid"] for node in json.loads(down.stdout)["brokers"]] == [started["pid"]]
    assert _kafka_processes(str(tmp_path)) == []
    assert json.loads(down.stdout)["monitoring"]["pids"] == {
        program: watching[program]["pid"] for program in ("prometheus", "pushgateway")
    }
    assert _monitoring_processes(str(tmp_path)) == []
    assert json.loads(down.stdout)["serving"] == {"was_running": True, "pid": serving["pid"]}
    assert not psutil.pid_exists(serving["pid"])
    assert json.loads(down.stdout)["object_store"] == store["pid"]
    assert _ended(store["pid"])  # SeaweedFS is killed after 15 s: a zombie until reaped
    assert not left.exists()

    stopped = run_duality(env, "status", "--json")
    assert stopped.returncode == 1  # the broker the settings name does not answer
    after = json.loads(stopped.stdout)["broker"]
    assert after["state"] == "stopped"
    assert after["reachable"] is False
