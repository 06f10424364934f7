"""The pipelines page in Airflow's UI (docs/pipelines-page.md): a FastAPI app that Airflow's API
server mounts under `/duality`, and a link to it in the UI's navigation.

`/duality/pipelines` is the page (HTML, `duality.overview_page`), `/duality/pipelines.json` the
same `duality.overview` as JSON, and `/duality/reports/<pipeline>/data_docs/` serves each
pipeline's Great Expectations Data Docs from DUALITY_REPORTS. Each needs the login Airflow's own
API asks for (its bearer token, or the UI's `_token` cookie) with the right to read DAGs; a page
asked for without one is sent to the login page. The library is imported when a page is asked
for: the scheduler and the DAG processor, which load plugins too, never import it.
"""

from __future__ import annotations

import dataclasses
import mimetypes
import re
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

if TYPE_CHECKING:
    from duality.overview import Overview
    from duality.storage.objects import ObjectPath

PREFIX = "/duality"
PAGE = f"{PREFIX}/pipelines"
URL_ROUTE = "duality-pipelines"  # the UI shows the page inside its own at /plugin/<this>
_PIPELINE_NAME = re.compile(r"[a-z][a-z0-9_]*")


async def reader(request: Request) -> None:
    """The request's Airflow login, found as Airflow's API finds it, may read DAGs; else 401
    (no login or an expired one) or 403."""
    from airflow.api_fastapi.core_api.security import bearer_scheme, get_user, requires_access_dag

    user = await get_user(request, None, await bearer_scheme(request))
    requires_access_dag("GET")(request, user)


app = FastAPI(title="duality pipelines", dependencies=[Depends(reader)])


@app.exception_handler(HTTPException)
async def _to_login(request: Request, error: HTTPException) -> Response:
    """A page asked for without a valid login goes to the login page, and back after it; JSON
    gets the status."""
    from airflow.api_fastapi.app import get_auth_manager

    wants_page = not request.url.path.endswith(".json")
    if wants_page and error.status_code in (401, 403):
        login = get_auth_manager().get_url_login(next_url=str(request.url))
        return RedirectResponse(login, status_code=303)
    return JSONResponse({"detail": error.detail}, status_code=error.status_code)


def _overview() -> Overview:
    from duality.overview import overview
    from duality_airflow.hooks import DualityHook

    # The settings of duality's tasks: kafka_default and spark_default take over.
    return overview(DualityHook().settings())


@app.get("/pipelines", response_class=HTMLResponse)
def pipelines_page(request: Request) -> HTMLResponse:
    from duality.overview_page import render

    # Airflow's UI is served where this app's mount point begins.
    airflow_root = request.scope.get("root_path", "").removesuffix(PREFIX)
    return HTMLResponse(render(_overview(), airflow_root=airflow_root, reports_url="reports"))


@app.get("/pipelines.json")
def pipelines_json() -> JSONResponse:
    return JSONResponse(dataclasses.asdict(_overview()))


@app.get("/reports/{pipeline}/data_docs/{path:path}")
async def data_docs(pipeline: str, path: str, request: Request) -> Response:
    """A file of the pipeline's Data Docs site (its index for the folder itself)."""
    from duality.config import Settings
    from duality.storage.objects import ObjectPath

    if not _PIPELINE_NAME.fullmatch(pipeline):
        raise HTTPException(404, f"no pipeline {pipeline!r}")
    site = Settings.from_env().reports / pipeline / "data_docs"
    if isinstance(site, ObjectPath):  # DUALITY_REPORTS on object storage
        return _object(site, path)
    files = StaticFiles(directory=site, html=True, check_dir=False)
    return await files.get_response(path or ".", request.scope)


def _object(site: ObjectPath, path: str) -> Response:
    """A file of a Data Docs site on object storage (its index for a folder)."""
    parts = [part for part in path.split("/") if part]
    if any(part in (".", "..") for part in parts):
        raise HTTPException(404, "no such file")
    wanted = site
    for part in parts:
        wanted = wanted / part
    if not parts or path.endswith("/"):
        wanted = wanted / "index.html"
    try:
        body = wanted.read_bytes()
    except FileNotFoundError:
        raise HTTPException(404, "no such file") from None
    kind = mimetypes.guess_type(wanted.name)[0] or "application/octet-stream"
    return Response(body, media_type=kind)


class DualityPipelinesPlugin(AirflowPlugin):
    name = "duality"
    fastapi_apps: ClassVar[list[dict[str, Any]]] = [
        {"app": app, "url_prefix": PREFIX, "name": "duality pipelines"}
    ]
    external_views: ClassVar[list[dict[str, Any]]] = [
        {
            "name": "Pipelines",
            "href": PAGE,
            "url_route": URL_ROUTE,
            "destination": "nav",
            "nav_top_level": True,
        }
    ]
