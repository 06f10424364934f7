"""What lets duality's Kafka clients ride through the loss of a broker: the settings that
change how they find a partition's new leader or a group's new coordinator, in one place, each
with its reason (docs/decisions/0033-riding-through-a-broker-loss.md)."""

from __future__ import annotations

# Kafka's Java clients in Spark: the Kafka source's admin client on the driver and its consumers
# on the executors take the same `kafka.*` options.
JAVA_CLIENT = {
    # The source's admin client binds each offsets call to the leader it looked up: when that
    # broker dies, the call waits for it until the call's timeout (60 s by default; 64-77 s
    # measured) although the controller moved the leadership after about 10 s. Spark's source
    # then asks again with a new admin client, which looks the leaders up anew: after 5 s, a
    # call bound to a dead leader costs at most that. On the executors it bounds a consumer's
    # position look-up the same way; one that times out fails its task, which Spark retries (on
    # a cluster) or the driver restarts the query (in local mode). At 3 s such timeouts failed
    # tasks on a busy host with no broker down.
    "default.api.timeout.ms": "5000",
    # Kafka's admin client raises its call timeout to the request timeout when that is longer.
    "request.timeout.ms": "5000",
}

# Spark's Kafka source: how often it asks for the offsets again, with a new admin client, before
# the query fails. Its default, 3 attempts a second apart, would fail a query within the 10-20 s
# a cluster takes to move a dead broker's leaderships; 12 attempts 0.5 s apart ride through a
# minute of it.
SPARK_SOURCE = {
    "fetchOffset.numRetries": "12",
    "fetchOffset.retryIntervalMs": "500",
    # An executor's fetch of records the micro-batch planned waits this long for them (by
    # default spark.network.timeout, 120 s). Its partition's leader killed under it, a task
    # waited so, 90 s and more, before its retry found the new leader; the records exist, so a
    # healthy leader gives them at once, and a task that times out is retried.
    "kafkaConsumer.pollTimeoutMs": "10000",
}
