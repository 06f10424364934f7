"""DAG tests load the DAG files as Airflow's DAG processor does, with Airflow's home, DAG folder
and plugins folder of their own (set before Airflow is first imported)."""

from __future__ import annotations

import os
import sys

from tests.harness import ROOT, own_airflow_home

own_airflow_home()
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(ROOT / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(ROOT / "plugins")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
if str(ROOT / "plugins") not in sys.path:
    sys.path.insert(0, str(ROOT / "plugins"))
