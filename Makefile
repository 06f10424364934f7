# duality: `make demo` runs the main job, `make test` passes the tests; each sets itself up.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
JAR_CACHE := $(abspath $(or $(DUALITY_JAR_CACHE),.cache/jars))
UV := $(VENV)/bin/uv
UV_VERSION := $(shell sed -n 's/^uv==//p' requirements.lock)
PY_STAMP := $(VENV)/.duality-installed
JAR_STAMP := $(JAR_CACHE)/.duality-fetched
# Class-data sharing for Spark drivers (`duality.spark.CLASS_ARCHIVE`, decision 31).
CLASS_ARCHIVE := $(VENV)/share/duality/spark-driver.jsa
# The same for drivers with S3A's jars on their class path (an object store configured), beside
# those jars (`duality.spark.class_archive`, decision 44).
S3A_CLASS_ARCHIVE := $(JAR_CACHE)/s3/spark-driver.jsa
# duality's stream-table join operator (decision 35) and Avro decoder (decision 38), compiled
# against pyspark's own jars.
JOIN_JAR := $(VENV)/share/duality/duality-join.jar
PYTEST_ARGS ?=

.PHONY: help setup browser postgres monitoring object-store demo test test-unit test-integration bench up down status lint lock clean

help:
	@echo "make demo    run the demo on the local stack (sets itself up)"
	@echo "make test    run the whole test suite (sets itself up)"
	@echo "make setup   virtual environment, pinned packages and jars (idempotent)"
	@echo "make bench   benchmarks; JSON under bench/results/"
	@echo "make up|down|status   the local stack"
	@echo "make lint    ruff and mypy"
	@echo "make lock    re-resolve requirements.lock from pyproject.toml"

setup: $(PY_STAMP) $(JAR_STAMP) $(JOIN_JAR) $(CLASS_ARCHIVE)

$(PY_STAMP): requirements.lock pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing the pinned packages (requirements.lock) and duality into $(VENV)"
	@# uv, pinned in the lock, installs in parallel: about two thirds of pip's time on a fresh
	@# machine (docs/testing.md).
	@$(PY) -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)
	@# Exactly the lock, less pyspark-client: the Spark provider's thin client would overwrite part
	@# of pyspark's own package, which has all of its modules.
	@grep -v '^pyspark-client==' requirements.lock > $(VENV)/requirements.txt
	@# A venv set up before (with pip) has it: uninstalling it takes files of pyspark's along,
	@# so pyspark goes too and the sync installs it whole.
	@if $(UV) pip show --quiet --python $(PY) pyspark-client >/dev/null 2>&1; then \
	  $(UV) pip uninstall --quiet --python $(PY) pyspark-client pyspark; fi
	@$(UV) pip sync --quiet --python $(PY) $(VENV)/requirements.txt
	@$(UV) pip install --quiet --python $(PY) --no-deps -e .
	@# Importing Airflow logs at INFO to stdout, which shows about 200 import-time messages of
	@# Great Expectations; at WARNING, warnings and errors still show.
	@echo "checking that pyspark, delta, confluent_kafka, airflow and great_expectations import"
	@AIRFLOW__LOGGING__LOGGING_LEVEL=WARNING \
	  $(PY) -c "import pyspark.sql, delta, confluent_kafka, airflow, great_expectations"
	@touch $@

$(JAR_STAMP): jars/broker/pom.xml jars/spark/pom.xml
	@command -v mvn >/dev/null || { echo "mvn is not installed: install Maven (apt-get install maven)"; exit 2; }
	@command -v java >/dev/null || { echo "java is not installed: install Java 17"; exit 2; }
	@for part in broker spark; do \
	  echo "fetching $$part jars into $(JAR_CACHE)/$$part"; \
	  rm -rf "$(JAR_CACHE)/$$part"; \
	  mvn --quiet --batch-mode -Dstyle.color=never -f jars/$$part/pom.xml dependency:copy-dependencies \
	    -Djar.cache="$(JAR_CACHE)" || exit 1; \
	done
	@touch $@

$(JOIN_JAR): include/duality/join/TableJoin.java include/duality/avro/ConfluentAvro.java $(PY_STAMP)
	@command -v javac >/dev/null || { echo "javac is not installed: install a Java 17 JDK"; exit 2; }
	@echo "compiling duality's stream-table join and Avro decoder ($@)"
	@rm -rf $(@D)/join-classes && mkdir -p $(@D)/join-classes
	@javac --release 17 -d $(@D)/join-classes \
	  -cp "$$($(PY) -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')/jars/*" $(filter %.java,$^)
	@jar cf $@ -C $(@D)/join-classes . && rm -rf $(@D)/join-classes

# The classes a Spark driver loads, archived once per installation: each driver JVM then maps
# them instead of loading them from the jars (about half of a session start's CPU).
$(CLASS_ARCHIVE): $(PY_STAMP) $(JAR_STAMP) $(JOIN_JAR)
	@echo "archiving the classes of a Spark driver for class-data sharing ($@)"
	@DUALITY_JAR_CACHE=$(JAR_CACHE) $(PY) -m duality.spark 2>$(VENV)/class-archive.log || \
	  { tail -n 40 $(VENV)/class-archive.log; exit 1; }

# Headless Chromium and its driver from Debian for the UI test (tests/e2e/test_airflow_ui.py);
# Selenium uses /usr/bin/chromium and /usr/bin/chromedriver and never downloads a browser.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  $$SUDO apt-get update && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
	    chromium chromium-driver; }

# PostgreSQL's server programs from Debian, for Airflow on PostgreSQL (DUALITY_AIRFLOW_DB=postgres,
# tests/integration/airflow/test_airflow_postgres.py). duality runs a server of its own under .local/
# from them; no cluster of the system's is made or started.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  $$SUDO mkdir -p /etc/postgresql-common/createcluster.d && \
	  echo "create_main_cluster = false" | \
	    $$SUDO tee /etc/postgresql-common/createcluster.d/duality.conf >/dev/null && \
	  $$SUDO apt-get update && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
	    postgresql; }

# Prometheus, promtool and the Pushgateway from Debian, for `duality up --monitoring` and the
# alert rules' tests (tests/unit/test_alert_rules.py). duality runs them under .local/monitoring/
# on ports of its own; the system's services are not used.
# Spark's S3A jars (640 MB from Maven Central), duality's log store for them and the class archive
# of drivers that load them, made once before the tests rather than by the first tests that need
# them, at once and beside the others. The S3 server itself (SeaweedFS) is a package of the lock.
object-store: $(S3A_CLASS_ARCHIVE)

$(S3A_CLASS_ARCHIVE): $(CLASS_ARCHIVE)
	@echo "fetching Spark's S3A jars and archiving the classes of a driver with them ($@)"
	@DUALITY_JAR_CACHE=$(JAR_CACHE) $(PY) -m duality.spark --s3a 2>$(VENV)/class-archive-s3a.log || \
	  { tail -n 40 $(VENV)/class-archive-s3a.log; exit 1; }

monitoring:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null && \
	  command -v prometheus-pushgateway >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  $$SUDO apt-get update && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
	    prometheus prometheus-pushgateway; }

demo: setup
	$(VENV)/bin/duality up --schema-registry
	$(VENV)/bin/duality demo

# Three workers (pytest-xdist), each running whole groups of tests that share a stack
# (docs/testing.md): on two cores, the workers' waits for brokers, Airflow and faults leave room
# for the others' work.
TEST_WORKERS ?= 3
PARALLEL := -n $(TEST_WORKERS) --dist loadscope

test: setup browser postgres monitoring object-store
	$(PY) -m pytest $(PARALLEL) $(PYTEST_ARGS)

test-unit: setup monitoring
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

test-integration: setup browser postgres monitoring object-store
	$(PY) -m pytest $(PARALLEL) -m "integration or e2e" $(PYTEST_ARGS)

bench: setup
	$(PY) bench/run.py $(BENCH_ARGS)

up: setup
	$(VENV)/bin/duality up --schema-registry

down:
	@if [ -x $(VENV)/bin/duality ]; then $(VENV)/bin/duality down; fi

status: setup
	$(VENV)/bin/duality status

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy include/duality

lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install --quiet --disable-pip-version-check -e ".[dev]"
	{ echo "# The whole resolved dependency set, pinned. Generated by \`make lock\` from pyproject.toml; do not edit."; \
	  .lock-venv/bin/pip freeze --exclude-editable | grep -v '^duality'; } > requirements.lock
	rm -rf .lock-venv

clean:
	rm -rf $(VENV) .cache .local .pytest_cache .mypy_cache .ruff_cache
