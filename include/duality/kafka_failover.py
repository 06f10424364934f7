"""What lets duality's Kafka clients ride through the loss of a broker: the settings that
change how they find a partition's new leader or a group's new coordinator, in one place, each
with its reason (docs/decisions/0033-riding-through-a-broker-loss.md)."""

from __future__ import annotations

# Spark sessions (the one builder, `duality.spark.session`): which client asks for the Kafka
# source's offsets each micro-batch.
SPARK_SESSION = {
    # Spark's default asks with an admin client, which binds each offsets call to the leader it
    # looked up: when that broker dies, the call waits for it until its timeout (60 s by
    # default; 64-77 s measured), although the controller moved the leadership after about
    # 10 s. Shorter timeouts cannot be given to that admin client alone: the executors'
    # consumers take the same options, and at 3 s they failed tasks on a busy host. A consumer
    # asks the new leader as soon as the metadata names it. Spark keeps this reader as
    # "deprecated" for a hang of older Kafka clients; a hang would end with the driver's stall
    # timeout.
    "spark.sql.streaming.kafka.useDeprecatedOffsetFetching": "true",
}
