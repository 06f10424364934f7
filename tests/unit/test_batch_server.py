"""The batch server's protocol and the local stack's launcher, on a fake Spark (what needs no
JVM; tests/integration/airflow/test_batch_server.py runs steps on a real one)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
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
from duality.local.batch_server import LocalBatchServer
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


@contextlib.contextmanager
def serving(step: Any) -> Iterator[BatchServer]:
    """A server on a free port of the loopback address; started in the test itself, since it
    routes sys.stdout and sys.stderr, which pytest sets again before each test."""
    running = BatchServer(("127.0.0.1", 0), FakeSpark(), step)  # type: ignore[arg-type]
    thread = threading.Thread(target=running.serve_forever, daemon=True)
    thread.start()
    try:
        yield running
    finally:
        running.shutdown()
        running.server_close()


def _settings(tmp_path: Path, server: BatchServer) -> Settings:
    address = f"127.0.0.1:{server.server_address[1]}"
    return Settings.from_env({"DUALITY_LOCAL_DIR": str(tmp_path)}).replace(batch_server=address)


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

    with serving(step) as server:
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

    with serving(step) as server:
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

    with serving(step) as server:
        settings = _settings(tmp_path, server)
        command = [sys.executable, "-c", _CLIENT, "snapshot"]
        client = subprocess.Popen(command, env={**os.environ, **settings.as_env()})
        try:
            assert started.wait(60), "the step never started"
            report = server_report(settings.batch_server or "")
            assert [s["command"] for s in report["steps"]] == ["snapshot"], report
            assert report["active_jobs"] == [7]
            client.kill()
            client.wait(30)
            assert_eventually(stopped.is_set, timeout=30, message="the step kept running")
            assert server.spark.sessions[-1].interrupted.is_set()  # type: ignore[attr-defined]
            assert_eventually(lambda: not server_report(settings.batch_server or "")["steps"])
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
    listening = BatchServer(("127.0.0.1", 0), FakeSpark(), cli.main)  # type: ignore[arg-type]
    settings = _settings(tmp_path, listening).replace(batch_server_wait_s=1.5)
    listening.server_close()  # nothing listens there any more
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
    with serving(step) as server:
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
    listening = BatchServer(("127.0.0.1", 0), FakeSpark(), cli.main)  # type: ignore[arg-type]
    settings = _settings(tmp_path, listening).replace(batch_server_wait_s=0.5)
    listening.server_close()
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
