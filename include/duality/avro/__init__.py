"""Avro sources in the Confluent wire format, read through a schema registry
(docs/streams.md#formats, decision 38): the registry's client (`registry`), the spec's columns
and reader schema from the subject's versions (`schema`, `source`), and the decoder the stream's
query runs in the JVM (`ConfluentAvro.java`, compiled into duality's jar by `make setup`;
`frame`)."""
