"""The local stack that `duality up` runs on this machine: one module per component (`broker`,
`kraft`, `spark_cluster`, `postgres`, `airflow`, `scram`) and `stack`, which starts, stops and
reports them as a whole."""
