"""duality: Kafka Streams' stream-table duality on Spark, Delta Lake and Airflow."""

__version__ = "0.1.0"
