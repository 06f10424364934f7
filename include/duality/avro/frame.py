"""The decoder of Avro records in the stream's query: `ConfluentAvro.java` (in duality's jar),
called through the JVM gateway, one call per record in the JVM."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import Column, SparkSession

    from duality.avro.source import AvroSource


def decode(
    spark: SparkSession, source: AvroSource, columns: Mapping[str, str], value: Column
) -> Column:
    """A struct of `p` (the record's `columns`, each a field of the reader schema, typed as a
    parsed JSON record's are, the reader schema's other fields not decoded; null when bad) and
    `error` (why it is bad, null when good; both null for a null value)."""
    from pyspark.sql.classic.column import Column as ClassicColumn

    jvm = spark._jvm
    assert jvm is not None
    # The reader schema projected on `columns`: Avro's resolution skips a writer's other fields.
    reader = json.loads(source.reader)
    reader["fields"] = [f for f in reader["fields"] if f["name"] in columns]
    decoded = jvm.duality.avro.ConfluentAvro.decode(
        value._jc,
        source.registry,
        source.authorization,
        json.dumps(reader),
        ",".join(f"{name}:{kind}" for name, kind in columns.items()),
    )
    return ClassicColumn(decoded)
