"""Pull queries (issue #48): replicas of a pipeline's table kept from its changelog and served
over HTTP (docs/serving.md, decision 36). `keys` the table's key and the position token, `store`
the replica's SQLite file, `replica` the changelog reader that fills it, `api` the HTTP API,
`client` what `duality query` asks the replicas with, `server` the `duality serve` process."""
