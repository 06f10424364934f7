"""The pipelines page in Airflow's UI (docs/pipelines-page.md), in headless Chromium: not
reachable without a login; after it, the navigation's link shows one row per pipeline, here one
whose stream runs under load with a validated snapshot and one that never ran. The screenshot
the README shows is taken here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from duality import process
from duality.spec import PipelineSpec
from duality.stream import heartbeat
from tests import truth
from tests.e2e.browser import Browser, chromium
from tests.harness import ROOT, assert_eventually, make_pipeline, read_topic
from tests.stack import Stack

PAGE = "/duality/pipelines"
NAV_ROUTE = "/plugin/duality-pipelines"
# Records produced while the page is looked at: at most 200/s, for longer than the test.
LOAD = ("--events", "1000000", "--rate", "200", "--seed", "4")
# The README's screenshot, written again only when asked (DUALITY_UPDATE_SCREENSHOTS=1), so
# that a test run leaves the checkout as it found it.
SCREENSHOT = ROOT / "docs" / "images" / "pipelines-page.png"


@dataclass
class Pipelines:
    running: PipelineSpec  # its stream runs, records keep coming, a snapshot is validated
    stopped: PipelineSpec  # its stream ran, and was stopped
    never_ran: PipelineSpec


@pytest.fixture(scope="module")
def pipelines(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipelines]:
    folder = stack.root / "pipelines"
    running = make_pipeline(stack.settings, folder, "product_sales")
    never_ran = make_pipeline(stack.settings, folder, "product_sales")
    stopped = make_pipeline(stack.settings, folder, "product_sales")
    for spec, seed in ((stopped, "2"), (running, "3")):
        produced = stack.duality("produce", spec.name, "--events", "3000", "--seed", seed)
        assert produced.returncode == 0, produced.stderr[-3000:]
    # `start` returns once the stream reports running; `stop` stops it gracefully.
    for step in ("start", "stop"):
        done = stack.duality("stream", step, stopped.name)
        assert done.returncode == 0, done.stderr[-3000:]
    assert _beat(stack, stopped).get("state") == "stopped"
    started = stack.duality("stream", "start", running.name)
    assert started.returncode == 0, started.stderr[-3000:]
    load = None
    try:
        assert_eventually(
            lambda: _beat(stack, running).get("dead_lettered", 0) > 0,
            timeout=180,
            interval=1.0,
            message="the stream's heartbeat never counted the produced bad records",
        )
        for step in ("snapshot", "validate"):
            done = stack.duality(step, running.name)
            assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        # Records keep coming while the page is looked at: batches with input, a moving chart.
        log = tmp_path_factory.mktemp("load") / "produce.log"
        with open(log, "wb") as out:
            load = subprocess.Popen(
                [sys.executable, "-m", "duality.cli", "produce", running.name, *LOAD],
                env={**os.environ, **stack.env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=ROOT,
            )

        def batches_with_input() -> int:
            recent = heartbeat.history(stack.settings, 0).get(running.name, [])
            return sum(1 for beat in recent if (beat.get("num_input_rows") or 0) > 0)

        assert_eventually(batches_with_input, lambda n: n >= 3, timeout=180, interval=1.0)
        assert (_beat(stack, running).get("input_rows_per_second") or 0) > 0
        yield Pipelines(running, stopped, never_ran)
    finally:
        if load is not None:
            process.kill_group(load.pid, reap=load)
        stack.duality("stream", "stop", running.name)


def _beat(stack: Stack, spec: PipelineSpec) -> dict[str, Any]:
    return heartbeat.latest(stack.settings).get(spec.name) or {}


def _assert_true_counts(
    stack: Stack, spec: PipelineSpec, batch: int, dead_letters: int, state_rows: int
) -> None:
    """The dead letters and state rows shown with micro-batch `batch` of a stream that started
    once are the ground truth (tests/truth.py) of its source records then: the bad ones among
    those its transactions had committed, and the keys the filter kept among those before the
    batch's end offsets. The records and offsets are read back with plain consumers, the
    offsets from the heartbeat of that batch whose counts the page shows."""
    beats = [
        beat
        for beat in heartbeat.history(stack.settings, 0).get(spec.name, [])
        if beat.get("batch_id") == batch and beat.get("source_offsets")
    ]
    assert beats, f"no heartbeat of batch {batch}"
    beat = beats[-1]
    assert (beat.get("dead_lettered"), beat.get("state_rows")) == (dead_letters, state_rows), beat
    source = read_topic(stack.settings, spec.source.topic)
    ends = {int(p): end for p, end in beat["source_offsets"][spec.source.topic].items()}
    committed = {int(p): end for p, end in beat["committed_offsets"].items()}
    _, bad = truth.expected(spec, [r for r in source if r[1] < committed.get(r[0], 0)])
    table, _ = truth.expected(spec, [r for r in source if r[1] < ends.get(r[0], 0)])
    assert (dead_letters, state_rows) == (len(bad), len(table)), (len(bad), len(table), beat)


@pytest.fixture
def ui(stack: Stack, tmp_path: Path) -> Iterator[Browser]:
    with chromium() as driver:
        yield Browser(driver, stack.settings.airflow_url, tmp_path / "ui-evidence")


def _get(stack: Stack, path: str, token: str | None = None) -> tuple[int, str, str]:
    """(status, final URL, body) of a GET, redirects followed."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(stack.settings.airflow_url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.url, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.url, error.read().decode(errors="replace")


def test_the_page_needs_a_login(stack: Stack, pipelines: Pipelines) -> None:
    status, _, _ = _get(stack, f"{PAGE}.json")
    assert status == 401
    status, _, _ = _get(stack, f"{PAGE}.json", token="not-a-token")
    assert status in (401, 403)
    for path in (PAGE, f"/duality/reports/{pipelines.running.name}/data_docs/"):
        status, url, body = _get(stack, path)
        assert "/auth/login" in url, (path, status, url)
        assert pipelines.running.name not in body


def test_the_json_tells_what_the_page_shows(stack: Stack, pipelines: Pipelines) -> None:
    status, _, body = _get(stack, f"{PAGE}.json", token=stack.client.token())
    assert status == 200, body[:2000]
    shown = json.loads(body)
    assert shown["kafka_up"] is True and shown["history_source"] == "heartbeats"
    rows = {row["name"]: row for row in shown["pipelines"]}
    running, never_ran = rows[pipelines.running.name], rows[pipelines.never_ran.name]
    stream = running["stream"]
    assert stream["state"] == "running", stream
    assert stream["lag"] is not None and stream["last_batch"] is not None, stream
    _assert_true_counts(
        stack, pipelines.running, stream["last_batch"], stream["dead_letters"], stream["state_rows"]
    )
    assert running["rate"] and running["lag"], "no input rate or lag over the last hour"
    snapshot = running["snapshot"]
    assert snapshot["published_version"] == 0 and snapshot["verdict"] == "passed", snapshot
    assert snapshot["data_docs"] == f"{pipelines.running.name}/data_docs/index.html"
    assert never_ran["stream"]["state"] == "never ran"
    assert never_ran["snapshot"]["exists"] is False
    assert never_ran["dags"]["stream"] == f"duality_{pipelines.never_ran.name}_stream"


def _rows_shown(names: list[str]) -> Callable[[WebDriver], bool]:
    def shown(driver: WebDriver) -> bool:
        return all(driver.find_elements(By.CSS_SELECTOR, f"tr[data-pipeline='{n}']") for n in names)

    return shown


def _cell(driver: WebDriver, pipeline: str, field: str) -> str:
    row = driver.find_element(By.CSS_SELECTOR, f"tr[data-pipeline='{pipeline}']")
    return " ".join(row.find_element(By.CSS_SELECTOR, f"[data-field='{field}']").text.split())


def test_the_pipelines_page_through_the_navigation(
    stack: Stack, pipelines: Pipelines, ui: Browser, tmp_path: Path
) -> None:
    running, never_ran = pipelines.running.name, pipelines.never_ran.name
    stopped = pipelines.stopped.name

    with ui.step("the page sends a visitor to the login, and back"):
        ui.log_in("admin", stack.password, path=PAGE)

    with ui.step("the navigation's link opens the page inside Airflow's UI"):
        ui.open("/")
        ui.click(By.CSS_SELECTOR, "a[aria-label='Pipelines']")
        ui.wait(lambda d: d.current_url.rstrip("/").endswith(NAV_ROUTE))
        frame = ui.visible(By.TAG_NAME, "iframe")
        assert (frame.get_attribute("src") or "").endswith(PAGE)
        ui.driver.switch_to.frame(frame)
        ui.wait(_rows_shown([running, stopped, never_ran]))

    with ui.step("the running pipeline's row"):
        driver = ui.driver
        assert _cell(driver, running, "state").startswith("running")
        assert _cell(driver, running, "input-rate").endswith("/s")
        last_batch = _cell(driver, running, "last-batch")
        assert last_batch.startswith("#"), last_batch
        dead_letters = int(_cell(driver, running, "dead-letters").replace(",", ""))
        state_rows = int(_cell(driver, running, "state-rows").replace(",", ""))
        assert _cell(driver, running, "snapshot").startswith("version 0")
        assert _cell(driver, running, "validation").startswith("passed version 0")
        row = driver.find_element(By.CSS_SELECTOR, f"tr[data-pipeline='{running}']")
        assert row.find_elements(By.CSS_SELECTOR, "svg.history polyline")
        dags = [a.get_attribute("href") for a in row.find_elements(By.CSS_SELECTOR, ".dags a")]
        assert any((href or "").endswith(f"/dags/duality_{running}_stream") for href in dags)

    with ui.step("the running pipeline's counts are the truth of its batch shown"):
        batch = int(last_batch[1:].split()[0])
        _assert_true_counts(stack, pipelines.running, batch, dead_letters, state_rows)

    with ui.step("the pipeline that was stopped, and the one that never ran"):
        assert _cell(driver, stopped, "state").startswith("stopped")
        assert _cell(driver, stopped, "snapshot") == "no snapshot yet"
        assert _cell(driver, never_ran, "state") == "never ran"
        assert _cell(driver, never_ran, "snapshot") == "no snapshot yet"

    with ui.step("screenshot"):
        driver.switch_to.default_content()
        update = os.environ.get("DUALITY_UPDATE_SCREENSHOTS") == "1"
        assert driver.save_screenshot(str(SCREENSHOT if update else tmp_path / SCREENSHOT.name))

    with ui.step("the Data Docs link opens the validation's report"):
        driver.switch_to.frame(ui.visible(By.TAG_NAME, "iframe"))
        row = driver.find_element(By.CSS_SELECTOR, f"tr[data-pipeline='{running}']")
        href = row.find_element(By.CSS_SELECTOR, "a[data-field='data-docs']").get_attribute("href")
        assert href and href.endswith(f"/duality/reports/{running}/data_docs/index.html")
        driver.get(href)
        ui.wait(lambda d: "Data Docs" in d.title or "Great Expectations" in d.page_source)
