"""Headless Chromium for the UI tests: Debian's `chromium` and `chromium-driver` packages (`make
browser` installs them), driven by Selenium with explicit paths, so nothing is ever downloaded."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARGS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000")

T = TypeVar("T")


@contextlib.contextmanager
def chromium() -> Iterator[WebDriver]:
    """A headless Chromium, quit afterwards (fails the test, saying how to fix it, without the
    Debian packages). Its temporary files (profile, single-instance socket: Chromium left the
    socket's folder in /tmp) go to a folder of its own, deleted after it quit."""
    for binary in (CHROMIUM, CHROMEDRIVER):
        if not binary.is_file():
            pytest.fail(
                f"{binary} is missing: run `make browser` (Debian chromium, chromium-driver)"
            )
    options = webdriver.ChromeOptions()
    # Both paths are explicit: Selenium Manager is skipped and never looks for a browser online.
    options.binary_location = str(CHROMIUM)
    for arg in ARGS:
        options.add_argument(arg)
    with tempfile.TemporaryDirectory(prefix="duality-chromium-") as scratch:
        options.add_argument(f"--user-data-dir={scratch}/profile")
        service = Service(executable_path=str(CHROMEDRIVER), env={**os.environ, "TMPDIR": scratch})
        driver = webdriver.Chrome(service=service, options=options)
        try:
            yield driver
        finally:
            driver.quit()


class Browser:
    """A driver with explicit waits, and evidence (screenshot, page source) when a step fails."""

    def __init__(self, driver: WebDriver, base_url: str, evidence: Path):
        self.driver = driver
        self.base_url = base_url.rstrip("/")
        self.evidence = evidence
        self._steps = 0

    def open(self, path: str) -> None:
        self.driver.get(self.base_url + path)

    def wait(
        self,
        condition: Callable[[WebDriver], T],
        timeout: float = 60.0,
        poll: float = 0.25,
        message: str = "",
    ) -> T:
        """Poll `condition` until it returns something truthy; returns that."""
        name = getattr(condition, "__name__", "condition")
        return WebDriverWait(self.driver, timeout, poll_frequency=poll).until(
            condition, message or f"{name} not met within {timeout:g}s"
        )

    def visible(self, by: str, value: str, timeout: float = 60.0) -> WebElement:
        """The first displayed element matching the locator, once there is one."""

        def found(driver: WebDriver) -> WebElement | bool:
            shown = [e for e in driver.find_elements(by, value) if e.is_displayed()]
            return shown[0] if shown else False

        message = f"nothing shown matches {by} {value!r} within {timeout:g}s"
        return self.wait(found, timeout, message=message)  # type: ignore[return-value]

    def click(self, by: str, value: str, timeout: float = 60.0) -> WebElement:
        """Wait until the element is shown and enabled, scroll it to the middle and click it."""

        def clickable(driver: WebDriver) -> WebElement | bool:
            for element in driver.find_elements(by, value):
                if element.is_displayed() and element.is_enabled():
                    return element
            return False

        message = f"nothing shown and enabled matches {by} {value!r} within {timeout:g}s"
        element: WebElement = self.wait(clickable, timeout, message=message)  # type: ignore[assignment]
        self.driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
        element.click()
        return element

    def snapshot(self, label: str) -> tuple[Path, Path]:
        """Save a screenshot and the page source; returns their paths."""
        self.evidence.mkdir(parents=True, exist_ok=True)
        stem = self.evidence / re.sub(r"[^a-zA-Z0-9_-]+", "-", label).strip("-")
        png, html = stem.with_suffix(".png"), stem.with_suffix(".html")
        with contextlib.suppress(Exception):
            self.driver.save_screenshot(str(png))
        with contextlib.suppress(Exception):
            html.write_text(self.driver.page_source)
        return png, html

    @contextlib.contextmanager
    def step(self, description: str) -> Iterator[None]:
        """One step of the scenario; when it fails, say which, where, and where the evidence is."""
        self._steps += 1
        try:
            yield
        except Exception as error:
            png, html = self.snapshot(f"{self._steps:02d}-{description}")
            try:
                url = self.driver.current_url
            except Exception:
                url = "?"
            raise AssertionError(
                f"UI step {description!r} failed at {url}: {type(error).__name__}: "
                f"{str(error).strip() or '(no message)'}"
                f"\n  screenshot: {png}\n  page source: {html}"
            ) from error

    def _typed(self, name: str, text: str) -> bool:
        try:
            field = self.visible(By.NAME, name)
            if field.get_attribute("value") != text:
                field.clear()
                field.send_keys(text)
            return field.get_attribute("value") == text
        except StaleElementReferenceException:  # rendered again meanwhile: the next poll types
            return False

    def log_in(self, user: str, password: str, path: str = "/") -> None:
        """Open `path`, which sends a visitor without a login to Airflow's login page, and log
        in there; Airflow then shows `path`."""
        self.open(path)
        self.wait(lambda d: "/auth/login" in d.current_url)
        # The login page may render its form again after it shows (it then comes back empty,
        # with Sign in disabled): type until each field holds its text.
        for name, text in (("username", user), ("password", password)):
            self.wait(lambda d, name=name, text=text: self._typed(name, text))
        self.click(By.XPATH, "//button[@type='submit' and normalize-space()='Sign in']")
        self.wait(lambda d: "/auth/login" not in d.current_url)
