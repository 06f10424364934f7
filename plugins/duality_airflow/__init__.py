"""duality's Airflow operators, sensors, triggers and hook: thin wrappers over `include/duality`.

Importing this package is cheap: nothing here imports Spark, Great Expectations or a Kafka
client at module level, so DAG files that use it parse quickly and touch no service.
"""
