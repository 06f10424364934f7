"""A location on object storage (`s3a://bucket/key`) with the part of pathlib's interface that
duality's code uses on its tables, checkpoints and reports, over pyarrow's S3 client. Object
storage has no folders: a "folder" is the keys below a prefix, `mkdir` does nothing, and a
folder exists while a key is below it."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import io
import posixpath
import types
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Any

from duality.errors import UsageError
from duality.secret_files import first_line

if TYPE_CHECKING:
    import pyarrow.fs as pafs

SCHEMES = ("s3a://", "s3://")
# Attempts of each request with AWS's standard backoff: a 503 "slow down" or a reset connection
# is retried; a server that stopped answering fails a step in seconds (4 s here against a
# closed port; ten attempts took 82 s).
RETRIES = 5


@dataclasses.dataclass(frozen=True)
class Store:
    """The S3 API's endpoint and credentials a location is reached with (the secret never
    shown: not in repr())."""

    endpoint: str | None
    region: str
    access_key: str | None
    secret_key: str | None = dataclasses.field(default=None, repr=False)
    secret_key_file: Path | None = None

    def secret(self) -> str | None:
        """The secret key: the setting's, else the first line of its file (read when first
        needed); None when neither is set. A file that cannot be read is a UsageError naming
        the setting (never the secret)."""
        if self.secret_key is not None:
            return self.secret_key.strip()
        if self.secret_key_file is None:
            return None
        setting = f"DUALITY_S3_SECRET_KEY_FILE={self.secret_key_file}"
        secret = first_line(self.secret_key_file, setting, "the object store's secret key")
        if not secret:
            raise UsageError(f"{setting} is empty: write the object store's secret key into it")
        return secret


@functools.cache
def filesystem(store: Store) -> pafs.S3FileSystem:
    """pyarrow's client of `store`, one per store and process: path-style requests, transient
    errors (a 503 "slow down", a reset connection) retried with backoff."""
    import pyarrow.fs as pafs

    if store.endpoint is None:
        raise UsageError(
            "a location is on object storage (s3a://…) and DUALITY_S3_ENDPOINT is not set: set "
            "it to the S3 API's URL (`duality up --object-store` starts a local one), or give a "
            "local path"
        )
    scheme, _, host = store.endpoint.rstrip("/").partition("://")
    return pafs.S3FileSystem(
        access_key=store.access_key,
        secret_key=store.secret(),
        anonymous=store.access_key is None,
        region=store.region,
        scheme=scheme,
        endpoint_override=host,
        connect_timeout=5,
        request_timeout=60,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=RETRIES),
    )


class ObjectPath:
    """`s3a://bucket/key`, reached through `store` once bound (`Settings` binds its
    locations to its own endpoint and credentials)."""

    __slots__ = ("bucket", "key", "store")

    def __init__(self, bucket: str, key: str, store: Store | None = None):
        self.bucket = bucket
        self.key = key.strip("/")
        self.store = store

    @classmethod
    def parse(cls, text: str) -> ObjectPath:
        rest = text.split("://", 1)[1]
        bucket, _, key = rest.partition("/")
        return cls(bucket, posixpath.normpath("/" + key).lstrip("/") if key else "")

    def on(self, store: Store) -> ObjectPath:
        return ObjectPath(self.bucket, self.key, store)

    # -- pure path ---------------------------------------------------------------------------
    def __str__(self) -> str:
        return f"s3a://{self.bucket}/{self.key}" if self.key else f"s3a://{self.bucket}"

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and (self.bucket, self.key) == (
            other.bucket,
            other.key,
        )

    def __hash__(self) -> int:
        return hash((self.bucket, self.key))

    def __truediv__(self, part: object) -> ObjectPath:
        joined = posixpath.join(self.key, str(part)) if self.key else str(part)
        return ObjectPath(self.bucket, joined, self.store)

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def stem(self) -> str:
        return PurePosixPath(self.name).stem

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.name).suffix

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.bucket, posixpath.dirname(self.key), self.store)

    def with_name(self, name: str) -> ObjectPath:
        return self.parent / name

    def relative_to(self, other: ObjectPath) -> PurePosixPath:
        return PurePosixPath(self.key).relative_to(other.key)

    def is_absolute(self) -> bool:
        return True

    def resolve(self) -> ObjectPath:
        return self

    def expanduser(self) -> ObjectPath:
        return self

    # -- the store ---------------------------------------------------------------------------
    @property
    def filesystem(self) -> pafs.S3FileSystem:
        if self.store is None:
            raise RuntimeError(f"{self} is not bound to an object store's settings")
        return filesystem(self.store)

    @property
    def arrow_path(self) -> str:
        """The path pyarrow's filesystem takes: `bucket/key`."""
        return f"{self.bucket}/{self.key}".rstrip("/")

    def _info(self) -> pafs.FileInfo:
        return self.filesystem.get_file_info(self.arrow_path)

    def exists(self) -> bool:
        import pyarrow.fs as pafs

        return bool(self._info().type != pafs.FileType.NotFound)

    def is_file(self) -> bool:
        import pyarrow.fs as pafs

        return bool(self._info().type == pafs.FileType.File)

    def is_dir(self) -> bool:
        import pyarrow.fs as pafs

        return bool(self._info().type == pafs.FileType.Directory)

    def _below(self, recursive: bool) -> list[pafs.FileInfo]:
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self.arrow_path, allow_not_found=True, recursive=recursive)
        return list(self.filesystem.get_file_info(selector))

    def _child(self, info: pafs.FileInfo) -> ObjectPath:
        return ObjectPath(self.bucket, info.path.split("/", 1)[1], self.store)

    def iterdir(self) -> Iterator[ObjectPath]:
        for info in self._below(recursive=False):
            yield self._child(info)

    def glob(self, pattern: str) -> Iterator[ObjectPath]:
        """The keys and folders right below this one whose names match `pattern`."""
        if "/" in pattern:
            raise ValueError(f"glob of {self}: only a name pattern, not {pattern!r}")
        for child in self.iterdir():
            if fnmatch.fnmatchcase(child.name, pattern):
                yield child

    def rglob(self, pattern: str) -> Iterator[ObjectPath]:
        """The keys at any depth below this one whose names match `pattern`."""
        import pyarrow.fs as pafs

        for info in self._below(recursive=True):
            if info.type == pafs.FileType.File and fnmatch.fnmatchcase(info.base_name, pattern):
                yield self._child(info)

    def read_bytes(self) -> bytes:
        with self.filesystem.open_input_stream(self.arrow_path) as stream:
            return bytes(stream.read())

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data: bytes) -> int:
        """One PUT: readers see the whole object or none of it."""
        with self.filesystem.open_output_stream(self.arrow_path) as stream:
            stream.write(data)
        return len(data)

    def write_text(self, text: str, encoding: str = "utf-8") -> int:
        return self.write_bytes(text.encode(encoding))

    def open(self, mode: str = "r", encoding: str | None = None) -> IO[Any]:
        """Reading: the object read whole (duality reads logs, markers and vectors, not data);
        writing: buffered, one PUT at close."""
        if mode in ("r", "rb"):
            data = io.BytesIO(self.read_bytes())
            return data if mode == "rb" else io.TextIOWrapper(data, encoding=encoding or "utf-8")
        if mode in ("w", "wb"):
            return _Upload(self, text=mode == "w", encoding=encoding or "utf-8")
        raise ValueError(f"open({self}): mode {mode!r} is not supported on object storage")

    def stat(self) -> types.SimpleNamespace:
        import pyarrow.fs as pafs

        info = self._info()
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(str(self))
        mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
        return types.SimpleNamespace(st_size=info.size or 0, st_mtime=mtime)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to do: object storage has no folders."""

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.filesystem.delete_file(self.arrow_path)
        except FileNotFoundError:
            if not missing_ok:
                raise


class _Upload(io.BytesIO):
    """A file opened for writing on object storage: sent as one PUT when closed."""

    def __init__(self, path: ObjectPath, text: bool, encoding: str):
        super().__init__()
        self._path, self._text, self._encoding = path, text, encoding

    def write(self, data: Any) -> int:
        return super().write(data.encode(self._encoding) if self._text else data)

    def close(self) -> None:
        if not self.closed:
            self._path.write_bytes(self.getvalue())
        super().close()
