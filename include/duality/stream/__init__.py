"""A pipeline's stream, source topic -> Spark's state store -> changelog topic (docs/streams.md)."""
