"""Delta in Spark reading every version of a pipeline's snapshot, for the object-store test
(`python -m tests.integration.snapshot.object_store_reader PIPELINE`), configured by its
DUALITY_* variables as any driver is: prints one JSON object, each version's rows by key
(the spec's aggregates), as `test_snapshot._table` reads them."""

from __future__ import annotations

import json
import sys

from duality.config import Settings
from duality.snapshot import delta_log
from duality.spark import session
from duality.spec import find_spec


def main(pipeline: str) -> None:
    settings = Settings.from_env()
    spec = find_spec(settings, pipeline)
    path = spec.snapshot_path(settings)
    spark = session(settings, f"object-store-reader-{pipeline}")
    versions: dict[int, dict[str, dict[str, object]]] = {}
    for entry in delta_log.history(path):
        frame = delta_log.load(spark, path, entry.version)
        rows = [row.asDict() for row in frame.collect()]
        table = {row["product"]: {c: row[c] for c in spec.aggregates} for row in rows}
        assert len(table) == len(rows), f"a key appears twice in version {entry.version}"
        versions[entry.version] = table
    spark.stop()
    print(json.dumps(versions))


if __name__ == "__main__":
    main(sys.argv[1])
