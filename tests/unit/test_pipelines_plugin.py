"""The Airflow plugin's pipelines page app, without an Airflow running: its routes serve the page,
its JSON and the Data Docs (never a file outside them), a request without a login gets 401, and
the plugin links the page from the UI's navigation."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from fastapi.testclient import TestClient

from duality import overview
from tests.harness import ROOT, own_airflow_home


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[ModuleType]:
    """The plugin module, its settings in `tmp_path` and no Kafka (a closed port)."""
    own_airflow_home()
    for name in list(os.environ):
        if name.startswith("AIRFLOW_CONN_"):
            monkeypatch.delenv(name)
    (tmp_path / "pipelines").mkdir()
    monkeypatch.setenv("DUALITY_HOME", str(tmp_path))
    monkeypatch.setenv("DUALITY_PIPELINES", str(tmp_path / "pipelines"))
    monkeypatch.setenv("DUALITY_REPORTS", str(tmp_path / "reports"))
    monkeypatch.setenv("DUALITY_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    monkeypatch.syspath_prepend(str(ROOT / "plugins"))
    from duality_airflow import pipelines_page

    yield pipelines_page
    pipelines_page.app.dependency_overrides.clear()


@pytest.fixture
def logged_in(page: ModuleType) -> TestClient:
    page.app.dependency_overrides[page.reader] = lambda: None
    return TestClient(page.app)


def test_without_a_login_the_json_is_401(page):  # type: ignore[no-untyped-def]
    answer = TestClient(page.app).get("/pipelines.json")
    assert answer.status_code == 401


def test_the_page_and_its_json(logged_in, monkeypatch):  # type: ignore[no-untyped-def]
    shown = overview.Overview(1.8e9, 3600.0, False, "Kafka is away", "none", "no history", [])
    monkeypatch.setattr(overview, "overview", lambda settings: shown)
    page = logged_in.get("/pipelines")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "Kafka is away" in page.text and 'href="pipelines.json"' in page.text
    data = logged_in.get("/pipelines.json")
    assert data.status_code == 200 and data.json() == shown.as_dict()


def test_data_docs_are_served_and_nothing_beside_them(logged_in, tmp_path):  # type: ignore[no-untyped-def]
    site = tmp_path / "reports" / "sales" / "data_docs"
    (site / "validations").mkdir(parents=True)
    (site / "index.html").write_text("<html>the index</html>")
    (site / "validations" / "run.html").write_text("<html>a run</html>")
    (tmp_path / "reports" / "sales" / "latest.json").write_text("{}")
    assert logged_in.get("/reports/sales/data_docs/").text == "<html>the index</html>"
    assert (
        logged_in.get("/reports/sales/data_docs/validations/run.html").text == "<html>a run</html>"
    )
    for outside in (
        "/reports/sales/data_docs/../latest.json",
        "/reports/sales/data_docs/%2e%2e/latest.json",
    ):
        assert logged_in.get(outside).status_code == 404, outside
    assert logged_in.get("/reports/Bad-Name/data_docs/").status_code == 404
    assert logged_in.get("/reports/other/data_docs/").status_code == 404


def test_the_plugin_mounts_the_app_and_links_it_in_the_navigation(page):  # type: ignore[no-untyped-def]
    plugin = page.DualityPipelinesPlugin
    assert plugin.fastapi_apps == [
        {"app": page.app, "url_prefix": "/duality", "name": "duality pipelines"}
    ]
    (view,) = plugin.external_views
    assert view["href"] == "/duality/pipelines" and view["destination"] == "nav"
    assert view["url_route"] == "duality-pipelines"
    # Where `duality demo` says the page is.
    assert overview.page_url("http://h:8080/") == "http://h:8080/plugin/duality-pipelines"
