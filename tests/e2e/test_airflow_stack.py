"""The product as users run it: `duality up` (broker + Airflow standalone), then a reduced
`duality demo` through the DAGs, then the stream supervisor against a SIGKILL."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psutil
import pytest

from duality import process
from duality.config import Settings
from duality.kafka import offsets, topics
from duality.spec import PipelineSpec, find_spec
from duality.stream import control
from tests import truth
from tests.harness import assert_eventually, read_latest, read_messages, read_topic
from tests.stack import Stack

SUPERVISE_INTERVAL_S = 60.0  # the stream DAG's schedule
DEMO_EVENTS = 3000


@pytest.fixture(scope="module")
def demo(stack: Stack) -> dict[str, Any]:
    done = stack.duality("demo", "--events", str(DEMO_EVENTS), "--seed", "7", "--json")
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout))


def test_up_prints_the_ui_address_and_a_login_that_works(stack: Stack):
    status = json.loads(stack.duality("status", "--json").stdout)
    assert status["airflow"]["state"] == "running" and status["airflow"]["healthy"]
    assert status["airflow"]["url"] == stack.settings.airflow_url
    assert status["broker"]["reachable"]
    assert stack.client.token()  # the printed password logs in
    again = stack.duality("up")  # idempotent, and says where and how to log in
    assert again.returncode == 0, again.stderr
    assert "already running" in again.stdout and stack.settings.airflow_url in again.stdout
    assert stack.password in again.stdout
    assert stack.client.import_errors() == []


def test_reduced_demo_tells_the_whole_story(stack: Stack, demo: dict[str, Any]):
    settings = stack.settings
    spec = find_spec(settings, "product_sales")
    # The ground truth of the demo's orders, read back: the table and the bad records.
    source = read_topic(settings, spec.source.topic)
    assert len(source) == DEMO_EVENTS
    table, bad = truth.expected(spec, source)
    produced = demo["produced"]
    assert produced["produced"] == DEMO_EVENTS
    # The workload's own count of what it made agrees with the truth, and so do the dead letters.
    assert (produced["valid"], sum(produced["bad"].values())) == (
        DEMO_EVENTS - len(bad),
        len(bad),
    ), (produced, len(bad))
    assert demo["dead_letters"] == len(bad)
    reasons = {}
    for message in read_messages(settings, spec.dlq_topic):
        headers = dict(message.headers() or [])
        where = (int(headers["duality.source.partition"]), int(headers["duality.source.offset"]))
        assert where not in reasons, f"{where} dead-lettered twice"
        reasons[where] = headers["duality.error"].decode()
    assert reasons.keys() == bad.keys()
    wrong = [(w, reasons[w], kind) for w, kind in bad.items() if not reasons[w].startswith(kind)]
    assert not wrong, wrong[:5]
    ran = demo["pipelines"]
    assert set(ran) == {"product_sales", "regional_sales", "tier_sales"}  # each one it ran
    assert demo["pipelines_page"] == f"{settings.airflow_url}/plugin/duality-pipelines"
    assert ran["product_sales"]["stream"]["source_records"] == DEMO_EVENTS
    assert ran["product_sales"]["dead_letters"] == demo["dead_letters"]

    snap = ran["product_sales"]["snapshot"]
    assert snap["validation"] == "passed" and snap["checks"] >= 10
    assert settings.location(snap["data_docs"]).is_file()
    assert settings.location(snap["report"]).is_file()
    read = stack.duality("read", "product_sales", "--json", "--limit", "0")
    assert read.returncode == 0, read.stderr[-3000:]
    published = json.loads(read.stdout)
    assert published["version"] == snap["version"]
    latest = read_latest(settings, spec)
    assert published["rows"] == snap["rows"] == len(table)
    truth.assert_tables_equal(truth.changelog_table(spec, latest), table)

    rich = ran["regional_sales"]  # a filter, computed fields, hopping windows
    assert rich["stream"]["source_records"] == DEMO_EVENTS
    rich_spec = find_spec(settings, "regional_sales")
    rows = _regional_rows(settings, rich_spec)
    assert rich["snapshot"]["validation"] == "passed"
    assert rich["snapshot"]["rows"] == rows, (rich, rows)

    _assert_tiers(settings, ran["tier_sales"], source)

    moved = demo["repartition"]
    copied = read_topic(settings, moved["target"])
    assert len(copied) == DEMO_EVENTS == moved["target_records"]
    assert topics.partition_count(settings, moved["target"]) == 12
    assert moved["skew_before"] > moved["skew_after"]
    assert settings.location(moved["plot"]).is_file()


def _assert_tiers(settings: Settings, ran: dict[str, Any], source: list[Any]) -> None:
    """tier_sales (the same orders, an inner join with the customers the demo wrote, by tier):
    the orders counted per tier, and those of customers without a row unmatched."""
    spec = find_spec(settings, "tier_sales")
    rows = {
        key.decode(): json.loads(value)
        for _, _, key, value in read_topic(settings, "customers")
        if key is not None and value is not None
    }
    assert ran["table"]["rows"] == len(rows) < 1000
    per_tier: dict[str, int] = {}
    unmatched = 0
    for *_, value in source:
        reason, order = truth.classify_record(spec, value)
        if reason is not None:
            continue
        row = rows.get(order["customer"])
        if row is None:
            unmatched += 1
        else:
            per_tier[row["tier"]] = per_tier.get(row["tier"], 0) + 1
    assert ran["stream"]["unmatched"] == unmatched > 0
    latest = read_latest(settings, spec)
    assert sorted(v["orders"] for v in latest.values()) == sorted(per_tier.values())
    assert ran["snapshot"]["validation"] == "passed"
    assert ran["snapshot"]["rows"] == len(per_tier) == 3


HOUR, QUARTER, TEN_MINUTES = 3_600_000, 900_000, 600_000  # regional_sales.yaml's window


def _regional_rows(settings: Settings, spec: PipelineSpec) -> int:
    """The rows of regional_sales's table, from its source records read back: the (region,
    band, window) of each paid order of a positive quantity, in each of its hourly windows
    (every 15 minutes) not ended by its micro-batch's watermark, recomputed here: the largest
    event time of such orders in earlier micro-batches minus 10 minutes (only the batches' end
    offsets come from the stream's checkpoint)."""
    checkpoint = settings.checkpoint_root / spec.name
    batches = truth.batches_from_checkpoint(checkpoint, spec.source.topic)
    kept: list[tuple[int, str, str, int]] = []  # (batch, region, band, event time)
    for partition, offset, _, value in read_topic(settings, spec.source.topic):
        reason, order = truth.classify_record(spec, value)
        if reason is not None or order["status"] != "paid" or order["quantity"] <= 0:
            continue
        batch = next(i for i, b in enumerate(batches) if offset < b.end_offsets[partition])
        band = "premium" if order["price"] >= 100 else "standard"
        moment = datetime.fromisoformat(order["ts"].replace("Z", "+00:00"))
        ts = (moment - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)
        kept.append((batch, order["region"], band, ts))
    watermarks, watermark = [], 0
    for index in range(len(batches)):
        watermarks.append(watermark)
        latest = [ts for batch, *_, ts in kept if batch == index]
        if latest:
            watermark = max(watermark, max(latest) - TEN_MINUTES)
    assert [b.watermark_ms for b in batches] == watermarks, (batches, watermarks)
    windows = set()
    for batch, region, band, ts in kept:
        last = ts - ts % QUARTER
        for start in range(last - HOUR + QUARTER, last + 1, QUARTER):
            if start + HOUR > watermarks[batch]:
                windows.add((region, band, start))
    return len(windows)


def test_supervisor_restarts_a_killed_stream_and_the_changelog_stays_exact(
    stack: Stack, demo: dict[str, Any]
):
    settings = stack.settings
    spec = find_spec(settings, "product_sales")
    pid = control.running_pid(settings, spec)
    assert pid is not None, "the demo left the stream to the supervisor, running"
    dag_id = "duality_product_sales_stream"
    assert stack.client.dag(dag_id)["is_paused"] is False

    # More events while it runs, then SIGKILL the whole stream (supervisor and driver).
    produced = stack.duality("produce", "product_sales", "--events", "2000", "--seed", "8")
    assert produced.returncode == 0, produced.stderr
    process.kill_group(os.getpgid(pid))
    killed_at = time.time()
    assert_eventually(lambda: not psutil.pid_exists(pid) or _zombie(pid), timeout=30)

    def restarted() -> int | None:
        new = control.running_pid(settings, spec)
        return new if new not in (None, pid) else None

    new_pid = assert_eventually(
        restarted,
        timeout=2 * SUPERVISE_INTERVAL_S + 30,
        interval=1.0,
        message="the supervisor DAG did not restart the stream",
    )
    started = psutil.Process(new_pid).create_time()
    assert started - killed_at <= 2 * SUPERVISE_INTERVAL_S, (
        f"restarted {started - killed_at:.0f}s after the kill"
    )

    def caught_up() -> bool:
        ends = offsets.end_offsets(settings, spec.source.topic)
        committed = offsets.committed_offsets(settings, spec.consumer_group, spec.source.topic)
        return all(committed.get(p, (0, None))[0] >= end for p, end in ends.items())

    assert_eventually(caught_up, timeout=300, interval=1.0, message="stream did not catch up")
    source = read_topic(settings, spec.source.topic)
    assert len(source) == DEMO_EVENTS + 2000
    table, _ = truth.expected(spec, source)
    truth.assert_tables_equal(truth.changelog_table(spec, read_latest(settings, spec)), table)


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
