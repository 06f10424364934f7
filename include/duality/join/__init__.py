"""Streams that meet tables (docs/streams.md#joins, decision 35): a pipeline's events joined
with the current row of a table, kept in Spark's state store by duality's JVM operator."""
