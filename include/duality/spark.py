"""The one Spark session builder: local jars (`spark.jars`, never Ivy, so sessions work
offline), Delta, RocksDB state with changelog checkpointing, the JVM's temporary files."""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import psutil

from duality import object_store
from duality.config import Settings
from duality.errors import UsageError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

# Every jar the Spark sessions need must be in the cache; these name the essential ones.
REQUIRED_JARS = ("spark-sql-kafka-0-10_2.13-", "delta-spark_4.1_2.13-", "kafka-clients-")

T = TypeVar("T")

_ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
# Zips of sources older than this, not used by a session since, are deleted when a new one is made.
_PACKAGE_ZIP_KEEP_S = 7 * 24 * 3600.0
# The classes a driver JVM loads, archived for class-data sharing by `make setup` (`python -m
# duality.spark`, decision 31): a driver maps them at start instead of reading, verifying and
# linking each from its jar, about half of a session start's CPU. A JVM that cannot use the
# archive (another JDK, jars changed since) starts as it would without it.
CLASS_ARCHIVE = Path(sys.prefix) / "share" / "duality" / "spark-driver.jsa"
# duality's stream-table join operator (duality.join, decision 35), compiled by `make setup`.
JOIN_JAR = Path(sys.prefix) / "share" / "duality" / "duality-join.jar"
_QUIET_CDS = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def spark_jars(settings: Settings) -> list[Path]:
    """The jar files every session loads, or a UsageError naming the fix when one is missing."""
    folder = settings.jar_cache / "spark"
    jars = sorted(folder.glob("*.jar"))
    names = [jar.name for jar in jars]
    missing = [prefix for prefix in REQUIRED_JARS if not any(n.startswith(prefix) for n in names)]
    if missing:
        raise UsageError(
            f"the jar cache {folder} lacks {', '.join(p.rstrip('-') for p in missing)}: "
            "run `make setup` (or set DUALITY_JAR_CACHE to the folder that holds them)"
        )
    if not JOIN_JAR.is_file():
        raise UsageError(f"{JOIN_JAR} (duality's stream-table join) is missing: run `make setup`")
    return [*jars, JOIN_JAR]


def package_zip(settings: Settings) -> Path:
    """The `duality` package as a zip that executors put on their Python path, named by the
    digest of its sources: a running application keeps serving the zip it started with."""
    import duality

    package = Path(duality.__file__).resolve().parent
    sources = sorted(
        path
        for path in package.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    )
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    folder = settings.local_dir / "pyfiles"
    target = folder / f"{package.name}-{digest.hexdigest()[:16]}.zip"
    if target.is_file():
        target.touch()
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed: a concurrent session never reads half a zip.
    handle, partial = tempfile.mkstemp(dir=folder, prefix=".partial-", suffix=".zip")
    try:
        with os.fdopen(handle, "wb") as raw, zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as zf:
            for path in sources:
                zf.write(path, f"{package.name}/{path.relative_to(package).as_posix()}")
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    for old in folder.glob(f"{package.name}-*.zip"):
        if old != target and time.time() - old.stat().st_mtime > _PACKAGE_ZIP_KEEP_S:
            old.unlink(missing_ok=True)
    return target


def _master_hosts(master: str) -> list[str]:
    """The hosts of a `spark://h1:p1[,h2:p2]` master URL."""
    addresses = master.removeprefix("spark://").split(",")
    return [address.rpartition(":")[0].strip("[]") for address in addresses]


def local_cores(master: str) -> int:
    """The cores of a `local`, `local[N]` or `local[*]` master (`local[N, retries]` too)."""
    match = re.fullmatch(r"local(?:\[(\*|\d+)(?:\s*,\s*\d+)?\])?", master.strip())
    if match is None:
        raise UsageError(
            f"DUALITY_SPARK_MASTER={master!r} is not a local master: use local, local[N] or "
            "local[*], or spark://host:port"
        )
    cores = match.group(1) or "1"
    if cores == "*":
        return os.cpu_count() or 1
    return max(1, int(cores))


def default_partitions(settings: Settings) -> int:
    """Shuffle partitions, and a stream's state partitions unless its spec or the settings say:
    in local mode one per core (each partition of a micro-batch costs a task and a state store
    commit, and more than the cores only queue: decision 18), 4 on a cluster."""
    if settings.spark_master.startswith("local"):
        return local_cores(settings.spark_master)
    return 4


def session_config(settings: Settings, app_name: str) -> dict[str, str]:
    """Every setting the builder applies, but for the driver's temporary folder, which `session`
    adds since it makes the folder; also what the compose stack's jobs are given."""
    local = settings.spark_master.startswith("local")
    config = {
        "spark.app.name": app_name,
        "spark.master": settings.spark_master,
        "spark.jars": ",".join(str(jar) for jar in spark_jars(settings)),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.sql.streaming.stateStore.providerClass": _ROCKSDB_PROVIDER,
        "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
        # All RocksDB instances of an executor share one memory budget (block cache and
        # memtables), so the state's memory does not grow with its keys; the rest is on disk.
        "spark.sql.streaming.stateStore.rocksdb.boundedMemoryUsage": "true",
        "spark.sql.streaming.stateStore.rocksdb.maxMemoryUsageMB": "128",
        "spark.sql.warehouse.dir": str(settings.warehouse),
        "spark.sql.session.timeZone": "UTC",
        "spark.driver.memory": settings.spark_driver_memory,
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.debug.maxToStringFields": "200",
        # A stateful query keeps one state store per shuffle partition, and its first checkpoint
        # fixes their number for good: Spark's 200 would be 200 RocksDB instances per stream.
        "spark.sql.shuffle.partitions": str(default_partitions(settings)),
        # Spark keeps 100 compiled classes of generated code by default, fewer than one Delta
        # MERGE and the reads around it generate: every snapshot run compiled all of them
        # again, and the JIT their new classes (docs/decisions/0020-generated-code-cache.md).
        "spark.sql.codegen.cache.maxEntries": "1000",
    }
    # S3A, when an object store is configured (docs/operations.md "Object storage"), and
    # duality's log store for Delta's commits there, beside Delta in `spark.jars`.
    s3a = object_store.s3a_config(settings)
    if s3a:
        config |= s3a
        config["spark.jars"] += f",{object_store.log_store_jar(settings)}"
    if local:
        cores = str(local_cores(settings.spark_master))
        config |= {
            "spark.default.parallelism": cores,
            "spark.ui.enabled": "false",
            "spark.sql.adaptive.enabled": "true",
            # Delta rebuilds a table's state from its log in this many tasks (default 50).
            "spark.databricks.delta.snapshotPartitions": "2",
            # VACUUM lists a table's files in this many tasks (default 10,000).
            "spark.sql.sources.parallelPartitionDiscovery.parallelism": cores,
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
        }
    else:
        config |= {
            # Executors import duality from this zip: a worker needs only Python and the
            # packages duality depends on, not duality itself.
            "spark.submit.pyFiles": str(package_zip(settings)),
            # One executor per core, small enough that a 1 GiB, 1-core worker takes one.
            "spark.executor.cores": "1",
            "spark.executor.memory": "512m",
            # An executor's temporary files (the native libraries it unpacks) go to its working
            # folder on the worker, not the worker's /tmp, where a killed executor left them
            # (docs/decisions/0022-jvm-temporary-files.md).
            "spark.executor.extraJavaOptions": "-Djava.io.tmpdir=.",
        }
        if settings.spark_cores_max is not None:
            config["spark.cores.max"] = str(settings.spark_cores_max)
        if settings.spark_master.startswith("spark://") and all(
            host in _LOCAL_HOSTS for host in _master_hosts(settings.spark_master)
        ):
            # A master on this machine (`LocalSparkCluster`): its workers reach the driver on
            # the loopback address, whatever the host name resolves to.
            config["spark.driver.host"] = "127.0.0.1"
            config["spark.driver.bindAddress"] = "127.0.0.1"
    return config


_STEP = threading.local()  # on a step's thread of the batch server: `session`, its own


def step_session() -> SparkSession | None:
    """The Spark session of the batch server's step this thread runs, or None."""
    return getattr(_STEP, "session", None)


def set_step_session(spark: SparkSession | None) -> None:
    """What `session` returns on this thread from now on (None: the process's own again)."""
    _STEP.session = spark


def session(
    settings: Settings, app_name: str = "duality", extra: Mapping[str, str] | None = None
) -> SparkSession:
    """The SparkSession for this process (created on first call, then reused); on the batch
    server, the session of the step this thread runs (`duality.batch_server`)."""
    from pyspark.sql import SparkSession

    step = step_session()
    if step is not None:
        return step
    # Driver and executors must run the interpreter that has duality installed.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    config = session_config(settings, app_name)
    archive = class_archive(settings)
    sharing = f"-XX:SharedArchiveFile={archive}" if archive.is_file() else None
    config |= scratch_config(scratch_folder(settings), sharing)  # this process's own folder
    config.update(extra or {})
    builder = SparkSession.builder
    for key, value in config.items():
        builder = builder.config(key, value)
    spark = _with_stdout_to_stderr(builder.getOrCreate)
    spark.sparkContext.setLogLevel("WARN")
    hadoop_secret(spark, settings)
    return spark


def hadoop_secret(spark: SparkSession, settings: Settings) -> None:
    """The object store's secret key on the session's Hadoop configuration, which S3A reads
    (and the executors get with each job), rather than in a `--conf` of the driver's command
    line, where `ps` would show it."""
    secret = settings.read_s3_secret_key()
    if settings.s3_endpoint and secret:
        spark.sparkContext._jsc.hadoopConfiguration().set("fs.s3a.secret.key", secret)


def class_archive(settings: Settings) -> Path:
    """The class archive for a driver of these settings (which may not have been written)."""
    if settings.s3_endpoint:
        # An archive serves only the class path it was written with (or one that extends it):
        # a driver with S3A's jars before Spark's on its class path maps its own, beside those
        # jars, which `make object-store` writes (decision 44).
        return object_store.s3a_folder(settings) / CLASS_ARCHIVE.name
    return CLASS_ARCHIVE


def scratch_config(folder: Path, sharing: str | None) -> dict[str, str]:
    """The driver JVM's temporary files (the native libraries it unpacks at start) and Spark's
    shuffle and spill files (`spark.local.dir` defaults to `java.io.tmpdir`) in `folder`; its
    class-data sharing option `sharing` (none if None)."""
    folder.mkdir(parents=True, exist_ok=True)
    options = f"-Djava.io.tmpdir={folder}"
    if sharing is not None:
        options += f" {sharing} {_QUIET_CDS}"
    return {"spark.driver.extraJavaOptions": options}


def scratch_folder(settings: Settings) -> Path:
    """This process's temporary folder for its JVM, `<local_dir>/jvm-tmp/<host>-<pid>`, made
    once per process, removed at its exit or by a later sweep
    (docs/decisions/0022-jvm-temporary-files.md)."""
    folder = settings.local_dir / "jvm-tmp" / f"{socket.gethostname()}-{os.getpid()}"
    if folder in _SCRATCH_MADE:
        return folder
    sweep_scratch(settings)
    # A folder of an earlier process that had this pid holds nothing of this one.
    shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.mkdir(parents=True)
    except OSError as error:
        raise UsageError(
            f"cannot make the JVM's temporary folder {folder} ({error.strerror}): set "
            "DUALITY_LOCAL_DIR to a folder this user can write"
        ) from None
    _SCRATCH_MADE.add(folder)
    atexit.register(_remove_scratch, folder, os.getpid())
    return folder


def sweep_scratch(settings: Settings) -> None:
    """Remove the JVM folders of this host's processes that have ended (also what `duality
    down` does)."""
    host = socket.gethostname()
    for folder in (settings.local_dir / "jvm-tmp").glob(f"{host}-*"):
        # `<host>-<pid>` of this host only (another host's name may start with this one's).
        pid = folder.name.removeprefix(f"{host}-")
        if pid.isdigit() and int(pid) != os.getpid() and _gone(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a killed process may stay a zombie for a while)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _remove_scratch(folder: Path, owner: int) -> None:
    """At exit, remove the process's folder. Its JVM ends right after (when its input closes)
    and has no work left to write there; whatever it might still write is removed by the next
    session's sweep. A forked child inherits this handler, not the JVM: it leaves the folder."""
    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


_SCRATCH_MADE: set[Path] = set()


def _with_stdout_to_stderr(start: Callable[[], T]) -> T:
    """Run `start` with file descriptor 1 pointing at stderr: the JVM it launches inherits it,
    so what Spark and Delta print goes to stderr, and stdout stays for results (`--json`)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        return start()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def write_class_archive(s3a: bool = False) -> Path:
    """Run a driver through what duality's drivers do (SQL, a shuffle, Delta writes, a MERGE and
    reads, a stateful streaming query on RocksDB) and archive the classes it loaded when its JVM
    exits; with `s3a`, a driver with S3A on its class path, which also makes an S3A client (no
    request is sent). In a process of its own: the JVM writes the archive as it ends."""
    from pyspark.sql import functions as F

    root = Path(tempfile.mkdtemp(prefix="duality-class-archive-"))
    settings = Settings.from_env().replace(
        local_dir=root / "local",
        warehouse=root / "warehouse",
        spark_master="local[2]",
        # With S3A, an endpoint that is never asked: the archive needs only the class path.
        s3_endpoint="http://127.0.0.1:9" if s3a else None,
        s3_access_key="class-archive",
        s3_secret_key="-",
        s3_secret_key_file=None,
    )
    archive = class_archive(settings)
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(f".{archive.name}.{os.getpid()}")
    dumping = scratch_config(scratch_folder(settings), f"-XX:ArchiveClassesAtExit={partial}")
    spark = session(settings, "duality-class-archive", dumping)
    try:
        if s3a:
            jvm = spark.sparkContext._jvm
            assert jvm is not None
            hadoop = spark.sparkContext._jsc.hadoopConfiguration()
            jvm.org.apache.hadoop.fs.Path("s3a://class-archive/").getFileSystem(hadoop)
        table = str(root / "table")
        rows = spark.range(1000).select((F.col("id") % 10).alias("k"), F.col("id").alias("v"))
        rows.groupBy("k").agg(F.sum("v").alias("v")).write.format("delta").save(table)
        from delta.tables import DeltaTable

        target = DeltaTable.forPath(spark, table).alias("t")
        target.merge(rows.limit(5).alias("s"), "t.k = s.k").whenMatchedUpdateAll().execute()
        spark.read.format("delta").load(table).orderBy("k").collect()
        rows.write.parquet(str(root / "source"))
        stream = (
            spark.readStream.schema(rows.schema)
            .parquet(str(root / "source"))
            .groupBy("k")
            .agg(F.count("v"))
            .writeStream.outputMode("update")
            .foreachBatch(_collect)
            .option("checkpointLocation", str(root / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        stream.awaitTermination()
    finally:
        spark.stop()
        gateway = spark.sparkContext._gateway
        jvm = getattr(gateway, "proc", None) if gateway is not None else None
        if jvm is not None:  # the JVM writes the archive as it exits: once its input closes
            jvm.stdin.close()
            jvm.wait(timeout=300)
        shutil.rmtree(root, ignore_errors=True)
    if not partial.is_file():
        raise UsageError(f"the JVM wrote no class archive at {partial}")
    partial.replace(archive)
    return archive


def _collect(frame: DataFrame, _batch: int) -> None:
    frame.collect()


if __name__ == "__main__":  # `make setup`; `make object-store` with --s3a
    print(f"wrote {write_class_archive(s3a='--s3a' in sys.argv[1:])}")
