"""A Spark driver of the object-store test (`python -m tests.integration.spark.object_store_writer
TABLE WRITER COMMITS`), configured by its DUALITY_* variables as any driver is: it appends
COMMITS batches of rows to the Delta table at TABLE (an s3a:// location), each commit tagged
with its writer and batch in its user metadata, then prints a JSON line: what S3A's conditional
create did, and whether its secret showed in the session's configuration or its command line."""

from __future__ import annotations

import json
import sys

import psutil

from duality.config import Settings
from duality.spark import session

ROWS = 50


def main(table: str, writer: str, commits: int) -> None:
    settings = Settings.from_env()
    spark = session(settings, f"object-store-writer-{writer}")
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
    # S3A's create without overwrite (what Delta's S3 log store commits with): of two streams
    # open on one new key, the one closed second is refused.
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    path = jvm.org.apache.hadoop.fs.Path(f"{table}-probe/{writer}/00000.json")
    fs = path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())  # type: ignore[union-attr]
    first, second = fs.create(path, False), fs.create(path, False)
    first.write(b"first")
    second.write(b"second")
    first.close()
    try:
        second.close()
        refused = None
    except Exception as error:  # py4j's Py4JJavaError: the Java exception's class and message
        refused = str(error).splitlines()[0][:300]
    stream = fs.open(path)
    kept = bytes(jvm.org.apache.commons.io.IOUtils.toByteArray(stream)).decode()
    stream.close()
    secret = settings.read_s3_secret_key() or ""
    conf = json.dumps(spark.sparkContext.getConf().getAll())
    jvms = [p for p in psutil.Process().children(recursive=True) if p.name() == "java"]
    cmdlines = " ".join(" ".join(p.cmdline()) for p in jvms)
    print(
        json.dumps(
            {
                "refused": refused,
                "kept": kept,
                "secret_in_conf": bool(secret) and secret in conf,
                "secret_in_cmdline": bool(secret) and secret in cmdlines,
                "jvms": len(jvms),
            }
        )
    )
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
