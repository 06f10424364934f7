"""Run one DAG with `dag.test()` here and print how it ended, as JSON: `python tests/run_dag.py
DAG_ID [CONF_JSON]`, run as a child with its own AIRFLOW_HOME so Airflow's config never leaks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    sys.path.insert(0, str(ROOT / "plugins"))
    from airflow.dag_processing.dagbag import DagBag

    dag_id = sys.argv[1]
    conf = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    bag = DagBag(dag_folder=str(ROOT / "dags"))
    if bag.import_errors:
        print(json.dumps({"import_errors": bag.import_errors}))
        return 2
    run = bag.dags[dag_id].test(run_conf=conf)
    tasks = {}
    for ti in run.get_task_instances():
        name = ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]"
        tasks[name] = ti.state
    print(json.dumps({"run_id": run.run_id, "state": run.state, "tasks": tasks}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
