"""Object storage through the S3 API (docs/operations.md "Object storage", decision 39): which
of duality's locations are `s3a://bucket/prefix` ones, the checks that stop a command before any
work when the endpoint, the credentials or the bucket are wrong, and the few requests duality
makes itself (signed with AWS Signature Version 4; Spark reaches the store through Hadoop's S3A,
delta-rs through its own client)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from duality import maven
from duality.config import PREFIX, Settings
from duality.errors import DualityError, UsageError
from duality.storage import is_remote, s3


def check_bucket(settings: Settings, bucket: str, setting: str) -> None:
    """Stop, naming `setting` (the location's) and the fix, unless the endpoint answers, takes
    the credentials and holds `bucket`."""
    answer = s3.request(settings.store(), "HEAD", f"/{bucket}")
    if answer.status == 200:
        return
    where = f"{PREFIX}S3_ENDPOINT={settings.s3_endpoint}"
    if answer.status in (401, 403):
        who = (
            f"{PREFIX}S3_ACCESS_KEY={settings.s3_access_key}"
            if settings.s3_access_key
            else f"no credentials ({PREFIX}S3_ACCESS_KEY is not set)"
        )
        raise UsageError(
            f"the object store at {where} refuses {who} for bucket {bucket!r} (HTTP "
            f"{answer.status}): set {PREFIX}S3_ACCESS_KEY and {PREFIX}S3_SECRET_KEY (or "
            f"{PREFIX}S3_SECRET_KEY_FILE; in Airflow, the aws_default connection's login and "
            "password) to a key that may read and write it"
        )
    if answer.status == 404:
        raise UsageError(
            f"{setting}: the bucket {bucket!r} does not exist at {where}: create it (`duality "
            f"up --object-store` creates {PREFIX}S3_BUCKET={settings.s3_bucket!r}), or name an "
            "existing bucket"
        )
    raise UsageError(
        f"{setting}: the object store at {where} answered HTTP {answer.status} "
        f"({s3.error_code(answer)}) for bucket {bucket!r}: check the endpoint and the bucket"
    )


def remote_locations(
    settings: Settings, extra: Iterable[tuple[str, str]] = ()
) -> list[tuple[str, str]]:
    """(setting, location) of every location of `settings` on object storage, and of `extra`."""
    named = [
        (f"{PREFIX}{name.upper()}", str(getattr(settings, name)))
        for name in ("warehouse", "checkpoint_root", "reports")
    ]
    return [(n, loc) for n, loc in [*named, *extra] if is_remote(loc)]


def preflight(settings: Settings, extra: Iterable[tuple[str, str]] = ()) -> None:
    """Before any work, when an object store is configured: the endpoint answers, takes the
    settings' credentials and holds the bucket (`S3_BUCKET`, and that of every location on
    object storage), or a UsageError naming the setting and the fix. Nothing to check when no
    endpoint is set and every location is local."""
    wanted = [(f"{PREFIX}S3_BUCKET", f"s3a://{settings.s3_bucket}")] if settings.s3_endpoint else []
    remote = remote_locations(settings, extra)
    if remote and not settings.s3_endpoint:
        setting, location = remote[0]
        raise UsageError(
            f"{setting}={location} is on object storage, and {PREFIX}S3_ENDPOINT is not set: "
            "set it to the S3 API's URL (http://host:port; `duality up --object-store` starts "
            f"a local one) with its credentials, or make {setting} a local folder"
        )
    checked: set[str] = set()
    for setting, location in [*wanted, *remote]:
        bucket, _ = s3.split(location)
        if bucket and bucket not in checked:
            check_bucket(settings, bucket, f"{setting}={location}")
            checked.add(bucket)


# The commands that stop before any work when the object store is not usable.
CHECKED_COMMANDS = frozenset(
    {"up", "stream start", "snapshot", "validate", "publish", "read", "repartition", "reset"}
)


def create_bucket(settings: Settings, bucket: str, timeout: float = 60.0) -> None:
    """Create `bucket` unless it exists; retried while the server is still starting (its S3
    gateway answers before its filer does)."""
    deadline = time.monotonic() + timeout
    while True:
        answer = s3.request(settings.store(), "HEAD", f"/{bucket}")
        if answer.status == 200:
            return
        if answer.status == 404:
            answer = s3.request(settings.store(), "PUT", f"/{bucket}", timeout=s3.WRITE_TIMEOUT_S)
            if answer.status in (200, 409):  # 409: made meanwhile
                return
        if time.monotonic() > deadline:
            raise UsageError(
                f"could not create the bucket {bucket!r} at {PREFIX}S3_ENDPOINT="
                f"{settings.s3_endpoint}: HTTP {answer.status} ({s3.error_code(answer)})"
            )
        time.sleep(0.5)


# hadoop-aws at the Hadoop version pyspark 4.1 bundles (its jars/hadoop-client-api-3.4.2.jar),
# the AWS SDK bundle it is built against, and the stream library its S3A input may use.
S3A_ARTIFACTS = (
    "org.apache.hadoop:hadoop-aws:3.4.2",
    "software.amazon.awssdk:bundle:2.29.52",
    "software.amazon.s3.analyticsaccelerator:analyticsaccelerator-s3:1.2.1",
)


def s3a_folder(settings: Settings) -> Path:
    """`<jar_cache>/s3`: S3A's jars, duality's log store for them, and the class archive of a
    driver that loads them (`duality.spark.class_archive`)."""
    return settings.jar_cache / "s3"


def s3a_jars(settings: Settings, progress: Callable[[str], None] = lambda _: None) -> list[Path]:
    """The S3A jars in `s3a_folder`, fetched from Maven Central the first time (the SDK
    bundle is 640 MB: only sessions that reach an object store load them, from this folder on
    the class path rather than through `spark.jars`, which would copy them to every executor)."""
    folder = s3a_folder(settings)
    names = [a.split(":")[1] + "-" + a.split(":")[2] + ".jar" for a in S3A_ARTIFACTS]
    if all((folder / name).is_file() for name in names):
        return [folder / name for name in names]
    # A folder of this process's own, renamed into place: drivers starting at once each fetch,
    # and the first rename wins.
    download = folder.with_name(f"s3.download-{os.getpid()}")
    shutil.rmtree(download, ignore_errors=True)
    download.mkdir(parents=True)
    try:
        for artifact in S3A_ARTIFACTS:
            progress(f"fetching {artifact} from Maven Central into {folder}")
            maven.copy(artifact, download)
    except DualityError:
        shutil.rmtree(download, ignore_errors=True)
        raise
    try:
        download.rename(folder)
    except OSError:  # another process's fetch is in place (or a partial folder is in the way)
        if not all((folder / name).is_file() for name in names):
            shutil.rmtree(folder, ignore_errors=True)
            download.rename(folder)
    shutil.rmtree(download, ignore_errors=True)
    return [folder / name for name in names]


# Delta's log store for s3a:// tables with several writers (decision 39), compiled the first time
# a session needs it, against pyspark's jars and the jar cache's delta-storage.
LOG_STORE_SOURCE = Path(__file__).parent / "s3a" / "ConditionalLogStore.java"
LOG_STORE_CLASS = "duality.s3a.ConditionalLogStore"


def log_store_jar(settings: Settings) -> Path:
    """`<jar_cache>/s3/duality-log-store-<digest>.jar`, compiled from LOG_STORE_SOURCE unless
    there (its name carries the source's digest: a changed source is compiled again). It goes
    on `spark.jars`, beside Delta, whose classes it extends."""
    import pyspark

    digest = hashlib.sha256(LOG_STORE_SOURCE.read_bytes()).hexdigest()[:16]
    jar = s3a_folder(settings) / f"duality-log-store-{digest}.jar"
    if jar.is_file():
        return jar
    javac, jar_tool = shutil.which("javac"), shutil.which("jar")
    if javac is None or jar_tool is None:
        raise UsageError("javac is not installed: install a Java 17 JDK")
    storage = sorted((settings.jar_cache / "spark").glob("delta-storage-*.jar"))
    if not storage:
        raise UsageError(
            f"the jar cache {settings.jar_cache / 'spark'} lacks delta-storage: run `make setup`"
        )
    classes = jar.with_name(f".classes-{os.getpid()}")
    shutil.rmtree(classes, ignore_errors=True)
    classpath = f"{Path(pyspark.__file__).parent / 'jars'}/*:{storage[-1]}"
    partial = jar.with_name(f".{jar.name}.{os.getpid()}")
    try:
        for command in (
            [javac, "--release", "17", "-d", str(classes), "-cp", classpath, str(LOG_STORE_SOURCE)],
            [jar_tool, "cf", str(partial), "-C", str(classes), "."],
        ):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                output = (done.stdout + done.stderr)[-2000:]
                raise UsageError(f"could not compile {LOG_STORE_SOURCE.name}:\n{output}")
        os.replace(partial, jar)
    finally:
        shutil.rmtree(classes, ignore_errors=True)
        partial.unlink(missing_ok=True)
    return jar


def s3a_config(settings: Settings) -> dict[str, str]:
    """Spark's settings for S3A when an object store is configured (but the secret, which
    `hadoop_secret` puts on the running session's Hadoop configuration: a `--conf` would show it
    in the driver's command line)."""
    if not settings.s3_endpoint:
        return {}
    jars = ":".join(str(jar) for jar in s3a_jars(settings))
    config = {
        "spark.driver.extraClassPath": jars,
        "spark.executor.extraClassPath": jars,
        "spark.hadoop.fs.s3a.endpoint": settings.s3_endpoint,
        "spark.hadoop.fs.s3a.endpoint.region": settings.s3_region,
        "spark.hadoop.fs.s3a.path.style.access": "true",
        "spark.hadoop.fs.s3a.connection.ssl.enabled": str(
            settings.s3_endpoint.startswith("https")
        ).lower(),
        # A commit file is created only if absent, by a PUT with If-None-Match: * (S3A's
        # conditional create, Hadoop 3.4.2, HADOOP-19256), through duality's log store: of two
        # drivers racing for `_delta_log/N.json` the second is refused (decision 39).
        "spark.hadoop.fs.s3a.create.conditional.enabled": "true",
        "spark.delta.logStore.s3a.impl": LOG_STORE_CLASS,
        "spark.delta.logStore.s3.impl": LOG_STORE_CLASS,
        # Transient errors (a 503 "slow down", a reset connection) are retried with backoff.
        "spark.hadoop.fs.s3a.retry.limit": "10",
        "spark.hadoop.fs.s3a.retry.interval": "500ms",
        "spark.hadoop.fs.s3a.retry.throttle.limit": "20",
        "spark.hadoop.fs.s3a.retry.throttle.interval": "500ms",
        "spark.hadoop.fs.s3a.attempts.maximum": "5",
        "spark.hadoop.fs.s3a.connection.establish.timeout": "5s",
        "spark.hadoop.fs.s3a.connection.timeout": "60s",
    }
    if settings.s3_access_key:
        config |= {
            "spark.hadoop.fs.s3a.aws.credentials.provider": (
                "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider"
            ),
            "spark.hadoop.fs.s3a.access.key": settings.s3_access_key,
        }
    return config


def delta_rs_options(settings: Settings) -> dict[str, str]:
    """Storage options for delta-rs (`deltalake`) to read `s3://` or `s3a://` tables of the
    settings' object store."""
    options = {
        "AWS_ENDPOINT_URL": str(settings.s3_endpoint),
        "AWS_REGION": settings.s3_region,
        "AWS_ALLOW_HTTP": str(str(settings.s3_endpoint).startswith("http://")).lower(),
        "AWS_S3_ADDRESSING_STYLE": "path",
    }
    secret = settings.read_s3_secret_key()
    if settings.s3_access_key and secret:
        options |= {"AWS_ACCESS_KEY_ID": settings.s3_access_key, "AWS_SECRET_ACCESS_KEY": secret}
    return options


if __name__ == "__main__":
    # `python -m duality.object_store`: create the settings' bucket unless it exists (what
    # docker-compose.yml's object-store-init does; `duality up --object-store` does it itself).
    from_env = Settings.from_env()
    create_bucket(from_env, from_env.s3_bucket)
    print(f"bucket {from_env.s3_bucket} at {from_env.s3_endpoint}")
