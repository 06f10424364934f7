"""A person's path through the real Airflow UI, in headless Chromium: log in, open the repartition
DAG, fill the trigger form's params, trigger it, and see the run succeed (DESIGN §9: every DAG a
person triggers has Params that the UI renders as a form)."""

from __future__ import annotations

import re
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from duality.kafka import offsets, topics
from tests.e2e.browser import Browser, chromium
from tests.harness import make_pipeline, read_topic
from tests.stack import Stack

DAG_ID = "duality_repartition"
PARTITIONS = 4
STRATEGY = "key-hash"


@pytest.fixture(scope="module")
def source(stack: Stack) -> str:
    """A produced source topic (3000 events) that is not in the repartition config."""
    stack.client.wait_for_dag(DAG_ID)
    spec = make_pipeline(stack.settings, stack.root / "pipelines", "product_sales")
    produced = stack.duality("produce", spec.name, "--events", "3000", "--seed", "1")
    assert produced.returncode == 0, produced.stderr[-3000:]
    return spec.source.topic


@pytest.fixture
def ui(stack: Stack, tmp_path: Path) -> Iterator[Browser]:
    with chromium() as driver:
        yield Browser(driver, stack.settings.airflow_url, tmp_path / "ui-evidence")


def url_path(driver: WebDriver) -> str:
    return urllib.parse.urlparse(driver.current_url).path


def new_run_page(driver: WebDriver) -> str:
    """The run id once the UI shows a run's page (where it goes after a trigger), else ""."""
    shown = re.fullmatch(f"/dags/{DAG_ID}/runs/(.+)", url_path(driver))
    return urllib.parse.unquote(shown.group(1)) if shown else ""


def run_state_in_list(run_id: str, reload_every: float = 20.0) -> Callable[[WebDriver], str | bool]:
    """A wait condition: the state badge of `run_id`'s row in the runs view once it is final.

    The list refreshes itself while runs are active; a reload now and then is only a fallback."""
    row = f"//tr[.//a[normalize-space()='{run_id}']]//*[@data-testid='state-badge']"
    reloaded = time.monotonic()

    def final(driver: WebDriver) -> str | bool:
        nonlocal reloaded
        badges = driver.find_elements(By.XPATH, row)
        state = " ".join(badges[0].text.split()).lower() if badges else ""
        if state in ("success", "failed"):
            return state
        if time.monotonic() - reloaded > reload_every:
            driver.refresh()
            reloaded = time.monotonic()
        return False

    return final


def test_trigger_repartition_from_the_form_and_see_it_succeed(
    stack: Stack, source: str, ui: Browser
) -> None:
    target = f"{source}-{PARTITIONS}p"

    with ui.step("log in"):
        ui.log_in("admin", stack.password)

    with ui.step("DAG list"):
        ui.click(By.CSS_SELECTOR, "a[aria-label='Dags']")
        ui.wait(lambda d: url_path(d) == "/dags")
        ui.click(By.XPATH, f"//a[@href='/dags/{DAG_ID}' and normalize-space()='{DAG_ID}']")

    with ui.step("DAG page"):
        ui.wait(lambda d: url_path(d) == f"/dags/{DAG_ID}")
        ui.visible(By.XPATH, f"//h2[normalize-space()='{DAG_ID}']")
        ui.click(By.CSS_SELECTOR, "button[aria-label='Trigger Dag']")

    dialog = "//*[@role='dialog' and @data-state='open']"
    with ui.step("trigger form"):
        ui.visible(By.XPATH, f"{dialog}//*[normalize-space()='Trigger Dag - {DAG_ID}']")
        # The Params form: one field per Param, titled as in the DAG, named `element_<param>`.
        for title in ("Topic", "Partitions", "Strategy", "Dry run"):
            ui.visible(By.XPATH, f"{dialog}//label[starts-with(normalize-space(), '{title}')]")
        ui.visible(By.NAME, "element_topic").send_keys(source)
        ui.visible(By.NAME, "element_partitions").send_keys(str(PARTITIONS))
        # The enum renders as a select: open it and pick the option.
        ui.click(By.XPATH, "//input[@name='element_strategy']/..//input[@role='combobox']")
        ui.click(By.XPATH, f"//*[@role='option' and normalize-space()='{STRATEGY}']")
        ui.wait(
            lambda d: d.find_element(By.NAME, "element_strategy").get_attribute("value") == STRATEGY
        )
        dry_run = ui.visible(
            By.XPATH, f"{dialog}//label[@data-scope='switch'][@id='switch:element_dry_run']"
        )
        assert dry_run.get_attribute("data-state") == "unchecked", "dry_run should be left off"
        # A new DAG is paused: the form's own checkbox unpauses it with the trigger.
        unpause = ui.driver.find_elements(
            By.XPATH, f"{dialog}//label[@data-scope='checkbox'][contains(., 'Unpause')]"
        )
        if unpause and unpause[0].get_attribute("data-state") != "checked":
            ui.driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", unpause[0])
            unpause[0].click()
        # The form writes the run's conf; Advanced Options shows it as JSON.
        ui.click(By.XPATH, f"{dialog}//button[contains(normalize-space(), 'Advanced Options')]")
        conf = (f'"topic": "{source}"', f'"partitions": {PARTITIONS}', f'"strategy": "{STRATEGY}"')

        def shows_conf(driver: WebDriver) -> bool:
            text = driver.find_element(By.XPATH, dialog).text
            return all(line in text for line in conf)

        ui.wait(shows_conf)

    with ui.step("trigger"):
        ui.click(By.XPATH, f"{dialog}//button[normalize-space()='Trigger']")
        # The UI goes to the new run's page.
        run_id = ui.wait(new_run_page)
        ui.visible(By.XPATH, f"//*[normalize-space()='{run_id}']")

    with ui.step("runs view shows the run succeed"):
        ui.click(By.XPATH, f"//a[@href='/dags/{DAG_ID}' and normalize-space()='{DAG_ID}']")
        ui.click(By.XPATH, f"//a[@href='/dags/{DAG_ID}/runs' and normalize-space()='Runs']")
        state = ui.wait(run_state_in_list(run_id), timeout=300, poll=1.0)
        assert state == "success", f"the run {run_id} ended {state}"

    with ui.step("the REST API agrees"):
        dag = stack.client.dag(DAG_ID)
        assert dag is not None and dag["is_paused"] is False, dag
        mine = [
            r for r in stack.client.runs(DAG_ID) if (r.get("conf") or {}).get("topic") == source
        ]
        assert len(mine) == 1, mine
        run = mine[0]
        assert run["dag_run_id"] == run_id, run
        assert run["run_type"] == "manual", run
        assert run["state"] == "success", run
        # Exactly what the form said: an integer partition count, dry_run left off.
        typed = {"topic": source, "partitions": PARTITIONS, "strategy": STRATEGY, "dry_run": False}
        assert run["conf"] == typed, run["conf"]

    with ui.step("the target topic holds the source's records"):
        assert topics.partition_count(stack.settings, target) == PARTITIONS
        source_ends = offsets.end_offsets(stack.settings, source)
        target_ends = offsets.end_offsets(stack.settings, target)
        assert set(target_ends) == set(range(PARTITIONS)), target_ends
        # The copy is transactional: commit markers take offsets too, so count the records.
        copied = len(read_topic(stack.settings, target))
        assert copied == sum(source_ends.values()) == len(read_topic(stack.settings, source))
        assert sum(target_ends.values()) >= copied, target_ends
