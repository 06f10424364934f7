"""A pipeline's stream: source topic -> a table in Spark's state store -> the changelog topic.

One Structured Streaming query per pipeline (`query`). Spark parses and classifies every source
record; the good ones feed a built-in streaming aggregation (Update mode) whose state lives in
the RocksDB state store, partitioned by group key over the executors. The query's output is the
union of the rows that aggregation changed in the micro-batch and the bad records, already
encoded as Kafka keys and values in the JVM. The driver (`driver`) only copies that output into
one Kafka transaction per micro-batch (`changelog_writer`): changelog records, dead letters, and
the source offsets the batch covers, committed to the pipeline's consumer group
(docs/decisions/0008-state-in-spark-state-store.md). Without a checkpoint the state is seeded
from the changelog (`seeding`).

`python -m duality.stream PIPELINE` runs the supervisor (`supervisor`), which holds the
pipeline's lock and pid file and runs the driver in a child process; `control` starts, stops
and describes streams, `health` holds the rules of the Airflow supervisor, and `heartbeat` the
status topic a running stream reports on.
"""
