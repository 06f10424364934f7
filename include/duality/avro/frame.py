"""The decoder of an Avro source's records in the stream's query: `ConfluentAvro.java` (in
duality's jar), called through the JVM gateway, one call per record in the JVM."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import Column, SparkSession

    from duality.avro.source import AvroSource


def decode(spark: SparkSession, source: AvroSource, value: Column) -> Column:
    """A struct of `json` (the record as JSON text of the reader schema, null when bad) and
    `error` (why it is bad, null when good; null for a null value too)."""
    from pyspark.sql.classic.column import Column as ClassicColumn

    jvm = spark._jvm
    assert jvm is not None
    decoded = jvm.duality.avro.ConfluentAvro.decode(
        value._jc,
        source.registry,
        source.authorization,
        source.reader,
    )
    return ClassicColumn(decoded)
