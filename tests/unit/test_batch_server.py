"""The batch server's protocol and the local stack's launcher, on a fake Spark (what needs no
JVM; tests/integration/airflow/test_batch_server.py runs steps on a real one)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from duality import batch_server, cli, spark
from duality.batch_server import BatchServer, run_remote, server_report
from duality.config import Settings
from duality.errors import CheckFailed, UsageError
from duality.local.batch_server import LocalBatchServer, self_signed_certificate
from duality.snapshot import delta_log
from tests.harness import ROOT, assert_eventually


class FakeSession:
    """What a step's session is asked for here: to interrupt its jobs."""

    def __init__(self) -> None:
        self.interrupted = threading.Event()

    def interruptAll(self) -> list[str]:
        self.interrupted.set()
        return []


class FakeTracker:
    def getActiveJobsIds(self) -> list[int]:
        return [7]


class FakeContext:
    def statusTracker(self) -> FakeTracker:
        return FakeTracker()


class FakeSpark:
    def __init__(self) -> None:
        self.sparkContext = FakeContext()
        self.sessions: list[FakeSession] = []

    def newSession(self) -> FakeSession:
        self.sessions.append(FakeSession())
        return self.sessions[-1]


# The servers' secret here; never in a log or an output.
SECRET = "unit-test-secret-0123456789abcdef"


def _own(tmp_path: Path) -> Settings:
    """The folders of a server (and by default of its clients) in `tmp_path`."""
    return Settings.from_env({"DUALITY_LOCAL_DIR": str(tmp_path)}).replace(
        warehouse=tmp_path / "warehouse",
        checkpoint_root=tmp_path / "checkpoints",
        reports=tmp_path / "reports",
    )


@contextlib.contextmanager
def serving(
    step: Any,
    tmp_path: Path,
    tls: ssl.SSLContext | None = None,
    own: Settings | None = None,
) -> Iterator[BatchServer]:
    """A server on a free port of the loopback address, with SECRET and the folders of
    `_own(tmp_path)`; started in the test itself, since it routes sys.stdout and sys.stderr,
    which pytest sets again before each test."""
    running = BatchServer(
        ("127.0.0.1", 0),
        FakeSpark(),  # type: ignore[arg-type]
        step,
        settings=own or _own(tmp_path),
        secret=SECRET,
        tls=tls,
    )
    thread = threading.Thread(target=running.serve_forever, daemon=True)
    thread.start()
    try:
        yield running
    finally:
        running.shutdown()
        running.server_close()


def _settings(tmp_path: Path, server: BatchServer) -> Settings:
    """A client's settings for `server`: its address and secret, its folders."""
    address = f"127.0.0.1:{server.server_address[1]}"
    return _own(tmp_path).replace(batch_server=address, batch_server_secret=SECRET)


def test_a_step_runs_with_the_clients_settings_and_its_output_comes_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    seen: dict[str, Any] = {}

    def step(argv: list[str], environ: dict[str, str], *, forward: bool) -> int:
        seen.update(argv=argv, pipelines=environ["DUALITY_PIPELINES"], forward=forward)
        seen["session"] = spark.step_session()
        print("a result")
        print("a warning", file=sys.stderr)
        return 3

    with serving(step, tmp_path) as server:
        settings = _settings(tmp_path, server).replace(pipelines=tmp_path / "specs")
        assert run_remote(settings, ["validate", "p", "--json"], "validate") == 3
        assert seen["argv"] == ["validate", "p", "--json"] and not seen["forward"]
        assert seen["pipelines"] == str(tmp_path / "specs")
        assert seen["session"] is server.spark.sessions[-1]  # type: ignore[attr-defined]
        assert spark.step_session() is None  # only on the step's thread
        out = capsys.readouterr()
        assert out.out == "a result\n" and out.err == "a warning\n"


def test_two_steps_at_once_each_get_a_session_and_their_own_output(tmp_path: Path):
    both = threading.Barrier(2, timeout=30)

    def step(argv: list[str], environ: dict[str, str], *, forward: bool) -> int:
        both.wait()  # both steps run at the same time
        print(f"{argv[0]} {id(spark.step_session())}")
        return 0

    with serving(step, tmp_path) as server:
        settings = _settings(tmp_path, server)
        outputs: dict[str, str] = {}

        def client(name: str) -> None:
            command = [sys.executable, "-c", _CLIENT, name]
            environment = {**os.environ, **settings.as_env()}
            done = subprocess.run(command, env=environment, capture_output=True, text=True)
            outputs[name + " stderr"] = done.stderr
            outputs[name] = done.stdout

        threads = [threading.Thread(target=client, args=(n,)) for n in ("a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        words = {name: outputs[name].split() for name in ("a", "b")}
        assert [words["a"][:1], words["b"][:1]] == [["a"], ["b"]], outputs
        assert words["a"][1] != words["b"][1]  # two sessions
        # The server's record of when each ran shows them at once.
        ended = server_report(settings)["ended"]
        assert sorted(step["command"] for step in ended) == ["a", "b"]
        assert max(s["started"] for s in ended) < min(s["ended"] for s in ended), ended


# A client in a process of its own, as a task runs it (the server runs in this test's process).
_CLIENT = """
import sys
from duality.batch_server import run_remote
from duality.config import Settings
sys.exit(run_remote(Settings.from_env(), [sys.argv[1]], sys.argv[1]))
"""


def test_a_client_killed_mid_step_interrupts_its_session_and_stops_the_step(tmp_path: Path):
    started, stopped = threading.Event(), threading.Event()

    def step(argv: list[str], environ: dict[str, str], *, forward: bool) -> int:
        started.set()
        try:
            while True:  # Python code that never returns by itself
                stopped.wait(0.05)
        except batch_server.StepCancelled:
            stopped.set()
            raise

    with serving(step, tmp_path) as server:
        settings = _settings(tmp_path, server)
        command = [sys.executable, "-c", _CLIENT, "snapshot"]
        client = subprocess.Popen(command, env={**os.environ, **settings.as_env()})
        try:
            assert started.wait(60), "the step never started"
            report = server_report(settings)
            assert [s["command"] for s in report["steps"]] == ["snapshot"], report
            assert report["active_jobs"] == [7]
            client.kill()
            client.wait(30)
            assert_eventually(stopped.is_set, timeout=30, message="the step kept running")
            assert server.spark.sessions[-1].interrupted.is_set()  # type: ignore[attr-defined]
            assert_eventually(lambda: not server_report(settings)["steps"])
        finally:
            client.kill()


def test_a_server_gone_mid_step_fails_the_step_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """A server that stops (or is killed) after part of a step: the client relays the part and
    fails, naming what happened and that a retry is the fix."""
    listening = socket.create_server(("127.0.0.1", 0))

    def half_a_step() -> None:
        connection, _ = listening.accept()
        with connection, connection.makefile("rb") as requests:
            requests.readline()
            connection.sendall(b'{"stream": "err", "text": "half the work\\n"}\n')

    thread = threading.Thread(target=half_a_step, daemon=True)
    thread.start()
    address = f"127.0.0.1:{listening.getsockname()[1]}"
    settings = Settings.from_env({"DUALITY_LOCAL_DIR": str(tmp_path)}).replace(batch_server=address)
    try:
        with pytest.raises(CheckFailed, match="closed the connection before `duality snapshot p`"):
            run_remote(settings, ["snapshot", "p"], "snapshot p")
    finally:
        listening.close()
    assert capsys.readouterr().err == "half the work\n"


def test_no_server_at_the_address_is_waited_for_then_names_the_fix(tmp_path: Path, capsys):
    listening = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listening.getsockname()[1]}"
    settings = _own(tmp_path).replace(batch_server=address, batch_server_wait_s=1.5)
    listening.close()  # nothing listens there any more
    with pytest.raises(UsageError, match=r"after 1.5 s: start it with `duality up`, or unset"):
        run_remote(settings, ["snapshot", "p"], "snapshot p")
    assert "does not answer yet; waiting up to 1.5 s" in capsys.readouterr().err


def test_only_batch_steps_go_to_the_server(tmp_path: Path, monkeypatch):
    sent: list[list[str]] = []
    monkeypatch.setattr(cli, "run_remote", lambda settings, argv, command: sent.append(argv) or 0)
    monkeypatch.setenv("DUALITY_BATCH_SERVER", "127.0.0.1:9")
    monkeypatch.setenv("DUALITY_LOCAL_DIR", str(tmp_path))
    assert cli.main(["snapshot", "product_sales", "--json"]) == 0
    assert (
        cli.main(["spec", "validate", str(ROOT / "include/duality/pipelines/product_sales.yaml")])
        == 0
    )
    assert sent == [["snapshot", "product_sales", "--json"]]


def test_a_batch_step_goes_to_the_server_without_loading_the_command_line(tmp_path: Path):
    """`python -m duality` (what Airflow's tasks run) sends a batch step to the server without
    importing `duality.cli`; the server's command line refuses a bad argument, as the client's
    would, and a command that is not a batch step runs in the client's own."""
    seen: list[list[str]] = []

    def step(argv: list[str], environ: dict[str, str], *, forward: bool) -> int:
        seen.append(argv)
        return cli.main(argv, environ, forward=forward) if "--bad" in argv else 0

    probe = (
        "import sys; from duality.__main__ import main; code = main(sys.argv[1:]); "
        "print('cli imported' if 'duality.cli' in sys.modules else 'cli not imported'); "
        "sys.exit(code)"
    )
    with serving(step, tmp_path) as server:
        env = {**os.environ, **_settings(tmp_path, server).as_env()}

        def client(*argv: str) -> subprocess.CompletedProcess[str]:
            command = [sys.executable, "-c", probe, *argv]
            return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

        sent = client("validate", "p", "--version", "3", "--json")
        assert (sent.returncode, sent.stdout) == (0, "cli not imported\n"), sent.stderr
        bad = client("publish", "p", "--bad")  # and no --version
        assert bad.returncode == 2, bad.stderr
        assert "duality publish: error: the following arguments are required: --version" in (
            bad.stderr
        )
        local = client(
            "spec", "validate", str(ROOT / "include/duality/pipelines/product_sales.yaml")
        )
        assert local.returncode == 0 and "cli imported" in local.stdout, local.stderr
    assert seen == [["validate", "p", "--version", "3", "--json"], ["publish", "p", "--bad"]]


def test_the_entry_point_says_why_the_server_did_not_answer(tmp_path: Path):
    listening = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listening.getsockname()[1]}"
    settings = _own(tmp_path).replace(batch_server=address, batch_server_wait_s=0.5)
    listening.close()
    env = {**os.environ, **settings.as_env()}
    command = [sys.executable, "-m", "duality", "snapshot", "p", "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "duality snapshot: error: the batch server" in done.stderr
    assert json.loads(done.stdout)["exit_code"] == 2


def test_a_path_is_one_sql_name_whatever_it_holds():
    assert delta_log.sql_name(Path("/w/a b")) == "delta.`/w/a b`"
    assert delta_log.sql_name(Path("/w/x`y")) == "delta.`/w/x``y`"


def test_the_local_server_takes_the_port_the_settings_name_on_this_machine(tmp_path: Path):
    named = Settings.from_env({"DUALITY_BATCH_SERVER": "localhost:15077"})
    server = LocalBatchServer(named.replace(local_dir=tmp_path))
    assert server._port() == 15077
    assert server.status().state == "stopped" and server.status().address is None
    assert json.dumps(server.stop().__dict__)  # stopping what does not run is fine


# --- security: the secret, TLS, the server's folders (docs/decisions/0034) -------------------


def _refused(settings: Settings, capsys: pytest.CaptureFixture[str], caplog: Any) -> str:
    """What the server answered `duality read p`, which must be a refusal; the secret is in
    no output and no log record."""
    with pytest.raises(batch_server.Refused) as refused:
        run_remote(settings, ["read", "p"], "read p")
    said = capsys.readouterr()
    for text in (str(refused.value), said.out, said.err, caplog.text):
        assert SECRET not in text
    return str(refused.value)


def test_a_request_without_the_secret_or_with_another_is_refused_and_nothing_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
):
    ran: list[list[str]] = []

    def step(argv: list[str], environ: dict[str, str], *, forward: bool) -> int:
        ran.append(argv)
        return 0

    caplog.set_level("INFO", logger="duality.batch_server")
    with serving(step, tmp_path) as server:
        settings = _settings(tmp_path, server)
        none = _refused(settings.replace(batch_server_secret=None), capsys, caplog)
        assert "refused `duality read p`: the request carries no secret: set " in none
        assert "DUALITY_BATCH_SERVER_SECRET_FILE" in none  # the fix
        wrong = settings.replace(batch_server_secret=SECRET[::-1])
        assert "the request's secret is not the server's" in _refused(wrong, capsys, caplog)
        # The status report too: it names the commands that run.
        with pytest.raises(batch_server.Refused, match="carries no secret"):
            server_report(settings.replace(batch_server_secret=None))
        assert ran == [] and server_report(settings)["ended"] == []
        assert caplog.text.count("refused a request from 127.0.0.1") == 3
        # The right one: the step runs, and its settings hold no secret.
        assert run_remote(settings, ["read", "p"], "read p") == 0
        assert ran == [["read", "p"]]
    assert SECRET not in caplog.text and SECRET not in str(capsys.readouterr())


def test_the_secret_stays_out_of_the_steps_settings_and_of_repr(tmp_path: Path):
    seen: dict[str, str] = {}

    def step(argv: list[str], environ: dict[str, str], *, forward: bool) -> int:
        seen.update(environ)
        return 0

    with serving(step, tmp_path) as server:
        settings = _settings(tmp_path, server)
        assert run_remote(settings, ["read", "p"], "read p") == 0
    assert seen["DUALITY_BATCH_SERVER"] == settings.batch_server
    assert not {k for k in seen if k.startswith("DUALITY_BATCH_SERVER_") and "WAIT" not in k}
    assert SECRET not in json.dumps(seen) and SECRET not in repr(settings)
    assert SECRET not in json.dumps(batch_server.step_env(settings))
    # A child process of a command (an Airflow task's) still gets it.
    assert settings.as_env()["DUALITY_BATCH_SERVER_SECRET"] == SECRET


def test_the_secret_is_a_setting_or_a_file_never_both(tmp_path: Path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    from_file = Settings.from_env({"DUALITY_BATCH_SERVER_SECRET_FILE": str(secret_file)})
    assert from_file.read_batch_server_secret() == SECRET
    with pytest.raises(UsageError, match=r"both DUALITY_BATCH_SERVER_SECRET and .*_FILE are set"):
        from_file.replace(batch_server_secret=SECRET)
    with pytest.raises(UsageError, match="DUALITY_BATCH_SERVER_SECRET is shorter than 16"):
        Settings.from_env({"DUALITY_BATCH_SERVER_SECRET": "short"})
    missing = from_file.replace(batch_server_secret_file=tmp_path / "nowhere")
    with pytest.raises(UsageError, match=r"SECRET_FILE=.*nowhere cannot be read \(No such file"):
        missing.read_batch_server_secret()
    secret_file.write_text("\n")
    with pytest.raises(UsageError, match="holds no secret of at least 16 characters"):
        from_file.read_batch_server_secret()
    with pytest.raises(UsageError, match="TLS_KEY is set without DUALITY_BATCH_SERVER_TLS_CERT"):
        Settings.from_env({"DUALITY_BATCH_SERVER_TLS_KEY": str(tmp_path / "k")})


def test_a_server_needs_a_secret_before_it_starts_spark(tmp_path: Path, monkeypatch):
    started: list[str] = []
    monkeypatch.setattr(batch_server, "session", lambda *a, **k: started.append("spark"))
    with pytest.raises(UsageError, match="the batch server needs a shared secret"):
        batch_server.serve(_own(tmp_path), "127.0.0.1", 0, cli.main)
    assert started == []


@pytest.mark.parametrize(
    ("setting", "outside"),
    [
        ("warehouse", "/etc"),
        ("checkpoint_root", "{root}/checkpoints/../elsewhere"),
        ("reports", "{root}/reports-link/x"),  # a link inside that leads outside
        ("local_dir", "/tmp"),
    ],
)
def test_settings_outside_the_servers_folders_are_refused_naming_the_setting(
    tmp_path: Path, capsys, caplog, setting: str, outside: str
):
    ran: list[list[str]] = []

    def step(argv: list[str], environ: dict[str, str], *, forward: bool) -> int:
        ran.append(argv)
        return 0

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "reports-link").symlink_to(tmp_path / "elsewhere")
    with serving(step, tmp_path) as server:
        settings = _settings(tmp_path, server)
        inside = settings.replace(**{setting: getattr(settings, setting) / "a" / ".." / "b"})
        assert run_remote(inside, ["read", "p"], "read p") == 0  # a folder in it is fine
        value = Path(outside.format(root=tmp_path))
        refused = _refused(settings.replace(**{setting: value}), capsys, caplog)
        name = f"DUALITY_{setting.upper()}"
        root = getattr(_own(tmp_path), setting).resolve()
        assert f"{name}={value} is outside the batch server's " in refused, refused
        assert f" {root}: set it to {root} (or a folder in it)" in refused
    assert ran == [["read", "p"]]


def test_locations_on_object_storage_are_confined_to_the_servers_bucket_and_prefix(
    tmp_path: Path, capsys, caplog
):
    """A server whose tables are in `s3a://duality/wh` takes steps under that prefix, on its
    object store; another bucket, a prefix that only starts alike, a local folder or another
    endpoint are refused, naming the setting."""
    ran: list[list[str]] = []

    def step(argv: list[str], environ: dict[str, str], *, forward: bool) -> int:
        ran.append(argv)
        return 0

    endpoint = {"s3_endpoint": "http://127.0.0.1:1", "s3_access_key": "k", "s3_secret_key": "s"}
    own = _own(tmp_path).replace(warehouse="s3a://duality/wh", **endpoint)
    with serving(step, tmp_path, own=own) as server:
        settings = _settings(tmp_path, server).replace(warehouse="s3a://duality/wh", **endpoint)
        assert run_remote(settings.replace(warehouse="s3a://duality/wh/a"), ["read", "p"], "") == 0
        for value in ("s3a://other/wh", "s3a://duality/whx", str(tmp_path / "warehouse")):
            refused = _refused(settings.replace(warehouse=value), capsys, caplog)
            assert f"DUALITY_WAREHOUSE={value} is outside the batch server's warehouse" in refused
        elsewhere = settings.replace(s3_endpoint="http://127.0.0.1:2")
        refused = _refused(elsewhere, capsys, caplog)
        assert "DUALITY_S3_ENDPOINT=http://127.0.0.1:2 is not the batch server's" in refused
    assert ran == [["read", "p"]]


def test_over_tls_a_client_needs_the_servers_certificate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
):
    certificate, key = tmp_path / "tls" / "server.crt", tmp_path / "tls" / "server.key"
    self_signed_certificate(certificate, key)
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    tls = batch_server.server_tls(
        _own(tmp_path).replace(batch_server_tls_cert=certificate, batch_server_tls_key=key)
    )
    with serving(lambda argv, environ, forward: print("over TLS") or 0, tmp_path, tls) as server:
        settings = _settings(tmp_path, server).replace(batch_server_tls_cert=certificate)
        assert run_remote(settings, ["read", "p"], "read p") == 0
        assert capsys.readouterr().out == "over TLS\n"
        plain = _refused(settings.replace(batch_server_tls_cert=None), capsys, caplog)
        assert "takes TLS connections only: set DUALITY_BATCH_SERVER_TLS_CERT" in plain
        other = tmp_path / "other.crt"
        self_signed_certificate(other, tmp_path / "other.key")
        with pytest.raises(UsageError, match=r"did not present the certificate of .*other\.crt"):
            run_remote(settings.replace(batch_server_tls_cert=other), ["read", "p"], "read p")
    with serving(lambda argv, environ, forward: 0, tmp_path) as plain_server:
        settings = _settings(tmp_path, plain_server).replace(batch_server_tls_cert=certificate)
        with pytest.raises(UsageError, match="no TLS connection to the batch server"):
            run_remote(settings, ["read", "p"], "read p")


def test_the_local_server_makes_its_secret_and_certificate_once(tmp_path: Path):
    server = LocalBatchServer(_own(tmp_path))
    made = server.credentials()
    secret = server.secret_file.read_text().strip()
    assert len(secret) >= 40 and oct(server.secret_file.stat().st_mode & 0o777) == "0o600"
    assert made == {
        "DUALITY_BATCH_SERVER_SECRET_FILE": str(server.secret_file),
        "DUALITY_BATCH_SERVER_TLS_CERT": str(server.tls_cert),
        "DUALITY_BATCH_SERVER_TLS_KEY": str(server.tls_key),
    }
    certificate = server.tls_cert.read_bytes()
    assert server.credentials() == made and server.secret_file.read_text().strip() == secret
    assert server.tls_cert.read_bytes() == certificate  # kept: clients hold it
    # Settings that name a secret of their own keep it; no file is recorded for the clients.
    named = LocalBatchServer(_own(tmp_path).replace(batch_server_secret=SECRET))
    assert "DUALITY_BATCH_SERVER_SECRET_FILE" not in named.credentials()
