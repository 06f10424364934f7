"""A pipeline end to end through SCRAM-SHA-512 (docs/decisions/0014-sasl-scram.md); Airflow's
`kafka_default` side is tests/unit/test_sasl.py's (a DAG here would cost minutes)."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from duality.config import Settings, jaas_quote
from duality.kafka import offsets
from duality.local.broker import ephemeral_broker
from duality.local.scram import Scram
from tests import truth
from tests.harness import assert_eventually, make_pipeline, read_latest, read_topic, run_duality

USER = "pipeline-user"
# Needs escaping in a JAAS string and in a properties file; the start is distinctive enough
# to search every byte of every file for.
MARK = "SaslPw-zQ7x"
PASSWORD = f'{MARK} "quoted" back\\slash; k=v  end'
WRONG = "not-the-password"
EVENTS = 3_000


class Run:
    """The module's secured broker, its pipeline, and every output of every command."""

    def __init__(self, settings: Settings, root: Path):
        self.settings = settings
        self.pipelines = root / "pipelines"
        self.spec = make_pipeline(settings, self.pipelines, "product_sales")
        self.outputs: list[str] = []

    def duality(
        self, *args: str, password: str = PASSWORD, expect: int = 0
    ) -> tuple[dict[str, Any], str, float]:
        """Run `duality ARGS --json`; (its JSON, its stderr, seconds it took)."""
        started = time.monotonic()
        login = self.settings.replace(pipelines=self.pipelines, sasl_password=password)
        result = run_duality(login, *args, "--json", timeout=300)
        took = time.monotonic() - started
        self.outputs += [result.stdout, result.stderr]
        assert result.returncode == expect, (args, result.stdout[-2000:], result.stderr[-3000:])
        return json.loads(result.stdout) if result.stdout.strip() else {}, result.stderr, took

    def folders(self) -> list[Path]:
        s = self.settings
        return [s.local_dir, s.checkpoint_root, s.warehouse, s.reports, self.pipelines]


@pytest.fixture(scope="module")
def run(base_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    root = tmp_path_factory.mktemp("sasl")
    # The broker's own folder (its logs included) is the local folder of every command.
    with ephemeral_broker(
        base_settings.replace(
            warehouse=root / "warehouse",
            checkpoint_root=root / "checkpoints",
            reports=root / "reports",
        ),
        scram=Scram({USER: PASSWORD}),
    ) as settings:
        assert settings.sasl_username == USER and settings.sasl_password == PASSWORD
        yield Run(settings, root)


def _delta_rows(path: Path, key: str, columns: list[str]) -> dict[tuple, dict]:
    """The rows of the Delta table's latest version, read from its log and Parquet files
    (not through Spark or duality): the files added and not removed since."""
    live: set[str] = set()
    for commit in sorted((path / "_delta_log").glob("*.json")):
        for line in commit.read_text().splitlines():
            action = json.loads(line)
            if "add" in action:
                live.add(action["add"]["path"])
            if "remove" in action:
                live.discard(action["remove"]["path"])
    rows: dict[tuple, dict] = {}
    for file in live:
        for row in pq.read_table(path / file).to_pylist():
            assert (row[key],) not in rows, f"key {row[key]!r} twice in the snapshot"
            rows[(row[key],)] = {c: row[c] for c in columns}
    return rows


def test_a_pipeline_end_to_end_through_the_sasl_listener(run: Run):
    settings, spec = run.settings, run.spec
    produced, _, _ = run.duality(
        "produce", spec.name, "--events", str(EVENTS), "--keys", "200", "--partitions", "3",
        "--bad-fraction", "0.03", "--seed", "7",
    )  # fmt: skip
    assert produced["produced"] == EVENTS

    with concurrent.futures.ThreadPoolExecutor(1) as background:
        # The repartition (transactional producers in Spark tasks) runs beside the stream.
        target = f"{spec.source.topic}-5p"
        copy = background.submit(
            run.duality, "repartition", spec.source.topic, "--to", target, "--partitions", "5"
        )
        # The stream: Spark's Kafka source, the transactional changelog, the heartbeats.
        started, _, _ = run.duality("stream", "start", spec.name, "--trigger-seconds", "0.5")
        try:
            assert started["state"] == "running"
            ends = offsets.end_offsets(settings, spec.source.topic)
            assert_eventually(
                lambda: {
                    p: o for p, (o, _) in offsets.committed_offsets(
                        settings, spec.consumer_group, spec.source.topic
                    ).items()
                } == ends,
                timeout=120,
                interval=1.0,
                message=f"the stream did not catch up; log {started['log']}",
            )  # fmt: skip
            run.duality("stream", "status", spec.name)
        finally:
            run.duality("stream", "stop", spec.name)
        copied, _, _ = copy.result()
    assert copied["copied"] == EVENTS
    assert len(read_topic(settings, target)) == EVENTS
    source = read_topic(settings, spec.source.topic)
    table, _ = truth.expected(spec, source, None)
    truth.assert_tables_equal(truth.changelog_table(spec, read_latest(settings, spec)), table)

    # The snapshot (Spark's Kafka source reads the changelog) equals the ground truth; it passes
    # validation and is published.
    built, _, _ = run.duality("snapshot", spec.name)
    assert built["rows"] == len(table)
    snapshot = _delta_rows(Path(built["path"]), spec.key_columns[0], list(spec.aggregates))
    truth.assert_tables_equal(snapshot, table)
    validated, _, _ = run.duality("validate", spec.name)
    assert validated["success"] and validated["published"]


def test_a_wrong_password_is_a_refused_login_naming_mechanism_and_user(run: Run):
    refused = f"refused the SASL SCRAM-SHA-512 login of user '{USER}'"
    for args, code in (
        (["status"], 1),
        (["lag"], 2),
        (["stream", "start", run.spec.name], 2),
    ):
        output, err, took = run.duality(*args, password=WRONG, expect=code)
        assert refused in err and refused in output["error"], (args, err)
        assert "invalid credentials" in err, err
        for misleading in ("timed out", "duality up", "cannot reach"):
            assert misleading not in err, (args, err)
        assert took < 15, f"{args}: {took:.1f}s"


def _leaks(folders: list[Path], texts: list[str]) -> list[tuple[str, str]]:
    """Where the password shows, in any form: raw, escaped as in a JAAS string or in JSON, or
    just its distinctive start."""
    forms = {PASSWORD, MARK, jaas_quote(PASSWORD)[1:-1], json.dumps(PASSWORD)[1:-1]}
    found = [(form, "command output") for text in texts for form in forms if form in text]
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                found += [(form, str(path)) for form in forms if form.encode() in data]
    return found


def test_the_password_is_in_no_file_and_no_output(run: Run, tmp_path: Path):
    status, _, _ = run.duality("status")
    assert status["broker"]["reachable"] is True
    files = [p for folder in run.folders() for p in folder.rglob("*") if p.is_file()]
    assert len(files) > 50 and len(run.outputs) >= 20, "did the pipeline run?"
    assert any(p.name == "server.log" for p in files)  # the broker's log is searched too
    assert not _leaks(run.folders(), run.outputs)

    # The search finds what it looks for.
    (tmp_path / "canary.json").write_text(json.dumps({"escaped": PASSWORD}))
    found = _leaks([tmp_path], [f"x{MARK}y"])
    assert (MARK, "command output") in found
    assert (json.dumps(PASSWORD)[1:-1], str(tmp_path / "canary.json")) in found
