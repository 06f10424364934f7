"""The Spark Connect server of the local stack, and Delta's SQL names: what needs no JVM."""

from __future__ import annotations

from pathlib import Path

from duality.config import Settings
from duality.local.spark_connect import LocalSparkConnect
from duality.snapshot import delta_log


def test_a_path_is_one_sql_name_whatever_it_holds():
    assert delta_log.sql_name(Path("/w/a b")) == "delta.`/w/a b`"
    assert delta_log.sql_name(Path("/w/x`y")) == "delta.`/w/x``y`"


def test_the_server_takes_the_port_the_settings_name_on_this_machine(tmp_path: Path):
    named = Settings.from_env({"DUALITY_SPARK_REMOTE": "sc://localhost:15077"})
    server = LocalSparkConnect(named.replace(local_dir=tmp_path))
    assert server._port() == 15077
    assert server.status().state == "stopped" and server.status().remote is None
