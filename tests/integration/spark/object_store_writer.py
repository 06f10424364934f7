"""A Spark driver of the object-store test (`python -m tests.integration.spark.object_store_writer
TABLE WRITER COMMITS first|next`), configured by its DUALITY_* variables as any driver is: it
appends COMMITS batches of rows to the Delta table at TABLE (an s3a:// location; `next` waits
for the first writer's version 0), each commit tagged with its writer and batch in its user
metadata, then prints a JSON line: what S3A's conditional create did, and whether its secret
showed in the session's configuration or its command line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import psutil
from py4j.protocol import Py4JJavaError

from duality.config import Settings
from duality.spark import class_archive, session

ROWS = 50


def main(table: str, writer: str, commits: int, first: bool) -> None:
    settings = Settings.from_env()
    spark = session(settings, f"object-store-writer-{writer}")
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    if not first:
        # The table is made by the first writer (two drivers creating one table at once is a
        # conflict Delta reports, not a race it retries); then both race for every version.
        log = jvm.org.apache.hadoop.fs.Path(f"{table}/_delta_log/{0:020d}.json")
        made = log.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())  # type: ignore[union-attr]
        deadline = time.monotonic() + 300
        while not made.exists(log):
            assert time.monotonic() < deadline, f"no version 0 of {table} after 300 s"
            time.sleep(0.1)
    for batch in range(commits):
        rows = spark.createDataFrame(
            [(writer, batch, n) for n in range(ROWS)], "writer string, batch int, n int"
        )
        (
            rows.write.format("delta")
            .mode("append")
            .option("userMetadata", f"{writer}:{batch}")
            .save(table)
        )
    # S3A's conditional create (what duality's log store commits with): of two streams open on
    # one new key, the one closed second is refused.
    path = jvm.org.apache.hadoop.fs.Path(f"{table}-probe/{writer}/00000.json")
    fs = path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())  # type: ignore[union-attr]

    def conditional() -> object:
        create = fs.createFile(path).overwrite(False)
        create.must("fs.option.create.conditional.overwrite", True)
        return create.build()

    first, second = conditional(), conditional()
    first.write(b"first")
    second.write(b"second")
    first.close()
    try:
        second.close()
        refused = None
    except Py4JJavaError as error:  # the Java exception's class and message
        java = error.java_exception
        refused = f"{java.getClass().getName()}: {java.getMessage()}"[:500]
    stream = fs.open(path)
    kept = bytes(jvm.org.apache.commons.io.IOUtils.toByteArray(stream)).decode()
    stream.close()
    secret = settings.read_s3_secret_key() or ""
    conf = json.dumps(spark.sparkContext.getConf().getAll())
    jvms = [p for p in psutil.Process().children(recursive=True) if p.name() == "java"]
    cmdlines = " ".join(" ".join(p.cmdline()) for p in jvms)
    # The JVM maps the class archive written with S3A's jars on its class path (decision 44).
    archive = str(class_archive(settings))
    maps = "".join(Path(f"/proc/{p.pid}/maps").read_text() for p in jvms)
    print(
        json.dumps(
            {
                "refused": refused,
                "kept": kept,
                "secret_in_conf": bool(secret) and secret in conf,
                "secret_in_cmdline": bool(secret) and secret in cmdlines,
                "jvms": len(jvms),
                "class_archive_mapped": archive.endswith("s3/spark-driver.jsa") and archive in maps,
            }
        )
    )
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "first")
