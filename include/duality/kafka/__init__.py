"""The only package that talks to Kafka (docs/decisions/0037-one-kafka-package.md): `client`
(connections, failures, retries), `topics`, `offsets`, `records`, and `failover` (the settings
that ride through a broker's loss)."""
