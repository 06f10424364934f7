"""The jar cache and the pinned versions agree with each other and with pyspark."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pyspark
import pytest

from duality.config import Settings
from duality.errors import UsageError
from duality.spark import scratch_config, scratch_folder, session_config, spark_jars
from tests.harness import ended_pid
from tests.unit.test_compose import NS, _pom
from tests.unit.test_compose import _lock_pins as _lock


def _pom_property(pom: str, name: str) -> str:
    value = _pom(pom).find(f"m:properties/m:{name}", NS)
    assert value is not None and value.text
    return value.text


def test_connector_matches_pyspark():
    assert _pom_property("spark", "spark.version") == pyspark.__version__ == _lock()["pyspark"]
    assert _lock()["pyspark-client"] == _lock()["pyspark"]


def test_delta_jar_matches_python_package():
    assert _pom_property("spark", "delta.version") == _lock()["delta-spark"]


def test_broker_is_kafka_4_1():
    assert re.fullmatch(r"4\.1\.\d+", _pom_property("broker", "kafka.version"))


def _artifact(jar: str) -> str:
    return re.sub(r"-\d[\w.\-]*\.jar$", "", jar)


def test_spark_jars_do_not_duplicate_what_spark_ships():
    settings = Settings.from_env()
    shipped = {_artifact(p.name) for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}
    ours = {_artifact(p.name) for p in spark_jars(settings)}
    assert ours, "the jar cache is empty: run make setup"
    assert ours & shipped == set()


def test_session_config_uses_local_jars_delta_and_rocksdb():
    config = session_config(Settings.from_env(), "app")
    jars = config["spark.jars"].split(",")
    assert all(Path(jar).is_file() for jar in jars)
    assert "spark.jars.packages" not in config
    assert config["spark.sql.extensions"] == "io.delta.sql.DeltaSparkSessionExtension"
    assert config["spark.sql.streaming.stateStore.providerClass"].endswith(
        "RocksDBStateStoreProvider"
    )
    assert config["spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled"] == "true"
    # More than a MERGE generates, so a warm snapshot run compiles none (decision 20).
    assert int(config["spark.sql.codegen.cache.maxEntries"]) >= 1_000


def test_a_driver_maps_the_class_archive_of_its_class_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from duality import spark

    archive = tmp_path / "spark-driver.jsa"
    monkeypatch.setattr(spark, "CLASS_ARCHIVE", archive)
    settings = Settings.from_env({"DUALITY_JAR_CACHE": str(tmp_path / "jars")})
    assert spark.class_archive(settings) == archive
    # With an object store, S3A's jars come first on the class path: the archive written with
    # them, beside them in the jar cache.
    s3 = settings.replace(s3_endpoint="http://127.0.0.1:9000")
    assert spark.class_archive(s3) == tmp_path / "jars" / "s3" / "spark-driver.jsa"
    options = scratch_config(tmp_path / "jvm", None)["spark.driver.extraJavaOptions"].split()
    assert options == [f"-Djava.io.tmpdir={tmp_path / 'jvm'}"]  # none: a plain start
    sharing = f"-XX:SharedArchiveFile={archive}"
    options = scratch_config(tmp_path / "jvm", sharing)["spark.driver.extraJavaOptions"].split()
    assert sharing in options
    # An archive this JVM cannot use (another JDK, changed jars) is passed over in silence.
    assert {"-Xlog:cds=off", "-Xlog:cds+dynamic=off"} <= set(options)


def test_a_cluster_session_ships_duality_as_a_zip(tmp_path: Path):
    import zipfile

    import duality

    settings = Settings.from_env().replace(
        spark_master="spark://127.0.0.1:7077", local_dir=tmp_path
    )
    config = session_config(settings, "app")
    shipped = Path(config["spark.submit.pyFiles"])
    assert shipped.parent == tmp_path / "pyfiles" and shipped.suffix == ".zip"
    package = Path(duality.__file__).parent
    sources = {f"duality/{p.relative_to(package).as_posix()}" for p in package.rglob("*.py")}
    assert sources <= set(zipfile.ZipFile(shipped).namelist())
    # Unchanged sources reuse the zip; a master on this machine reaches the driver on loopback.
    assert session_config(settings, "app")["spark.submit.pyFiles"] == str(shipped)
    assert config["spark.driver.host"] == config["spark.driver.bindAddress"] == "127.0.0.1"

    remote = session_config(settings.replace(spark_master="spark://spark-master:7077"), "app")
    assert "spark.driver.host" not in remote and remote["spark.submit.pyFiles"] == str(shipped)
    local = session_config(settings.replace(spark_master="local[2]"), "app")
    assert "spark.submit.pyFiles" not in local


@pytest.mark.parametrize(
    ("master", "partitions"),
    [("local", "1"), ("local[2]", "2"), ("local[3, 4]", "3"), ("spark://127.0.0.1:7077", "4")],
)
def test_one_partition_per_local_core(master: str, partitions: str, tmp_path: Path):
    # Each partition of a micro-batch is a task and a state store commit: in local mode no more
    # of them than cores; a cluster's streams keep 4 state partitions to spread over workers.
    config = session_config(
        Settings.from_env().replace(spark_master=master, local_dir=tmp_path), "app"
    )
    assert config["spark.sql.shuffle.partitions"] == partitions


def test_a_bad_local_master_names_the_fix():
    with pytest.raises(UsageError, match=r"local\[N\]"):
        session_config(Settings.from_env().replace(spark_master="local[two]"), "app")


def test_missing_jar_cache_names_the_fix(tmp_path: Path):
    settings = Settings.from_env().replace(jar_cache=tmp_path)
    with pytest.raises(UsageError, match="make setup"):
        spark_jars(settings)


def test_scratch_folder_sweeps_only_the_ended_processes_of_this_host(tmp_path: Path):
    settings = Settings.from_env().replace(local_dir=tmp_path)
    root, host = tmp_path / "jvm-tmp", socket.gethostname()
    dead = ended_pid()
    folders = {
        "ended": root / f"{host}-{dead}",
        "running": root / f"{host}-{os.getppid()}",
        "other host": root / f"other{host}-{dead}",
        "longer host name": root / f"{host}-2-{dead}",
    }
    for folder in folders.values():
        (folder / "blockmgr-1").mkdir(parents=True)

    mine = scratch_folder(settings)

    assert mine == root / f"{host}-{os.getpid()}" and mine.is_dir()
    assert not folders["ended"].exists()
    assert all(folders[k].is_dir() for k in ("running", "other host", "longer host name"))
    assert scratch_folder(settings) == mine  # one folder per process


def test_scratch_folder_that_cannot_be_made_names_the_setting(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(UsageError, match="DUALITY_LOCAL_DIR") as error:
        scratch_folder(Settings.from_env().replace(local_dir=blocker))
    assert str(blocker) in str(error.value)
