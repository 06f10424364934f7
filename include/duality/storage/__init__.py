"""Where duality keeps its tables, checkpoints and reports (decision 41): a local folder (a
`pathlib.Path`) or an object storage location (`s3a://bucket/prefix`, an `ObjectPath` with the
same interface for what duality does with them). The few operations pathlib lacks, or that
differ on object storage (removing a folder, creating a file only if absent, giving pyarrow a
filesystem), are here."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from duality.storage import s3
from duality.storage.objects import SCHEMES, ObjectPath, Store

if TYPE_CHECKING:
    import pyarrow.fs as pafs

Location = Path | ObjectPath

__all__ = ["Location", "ObjectPath", "Store", "is_remote", "parse", "remove_tree"]


def is_remote(location: object) -> bool:
    """Whether `location` (a setting's value, a spec's path) is on object storage."""
    return isinstance(location, ObjectPath) or str(location).startswith(SCHEMES)


def parse(text: str) -> Location:
    """`s3a://…` or `s3://…` as an (unbound) ObjectPath, anything else as a local path."""
    return ObjectPath.parse(text) if is_remote(text) else Path(text).expanduser()


def remove_tree(location: Location) -> None:
    """The folder and everything below it gone (nothing to do when it is not there)."""
    if isinstance(location, ObjectPath):
        import pyarrow.fs as pafs

        fs = location.filesystem
        # Folder by folder (a listing with a delimiter): a server whose folders are real
        # (SeaweedFS's filer) lists an emptied folder made by a marker (S3A's mkdirs: `key/`)
        # there, never in a recursive listing.
        folders, pending = [], [location.arrow_path]
        while pending:
            below = pafs.FileSelector(pending.pop(), allow_not_found=True)
            for info in fs.get_file_info(below):
                if info.type == pafs.FileType.Directory:
                    folders.append(info.path)
                    pending.append(info.path)
        # The keys below it, and the folder itself where the server keeps one.
        with contextlib.suppress(FileNotFoundError):
            fs.delete_dir(location.arrow_path)
        # Such a server also keeps a marked folder whose deletion came while it still held keys
        # (pyarrow deletes parents first), and Spark takes it for a checkpoint's state not
        # empty: each folder deleted again, deepest first (on S3, requests that change nothing).
        assert location.store is not None  # `filesystem` needs it
        for folder in sorted([*folders, location.arrow_path], key=len, reverse=True):
            s3.request(location.store, "DELETE", f"/{folder}/", timeout=s3.WRITE_TIMEOUT_S)
    else:
        shutil.rmtree(location, ignore_errors=True)


def create_if_absent(final: Location, data: bytes) -> bool:
    """`final` holding `data`, created only if absent, so that of two writers racing for one
    name exactly one wins and no reader ever sees a partial file; whether this call created it.
    Locally a hard link of a complete file; on object storage one PUT with `If-None-Match: *`,
    which the server refuses (412) when the key exists (decision 39)."""
    if isinstance(final, ObjectPath):
        if final.store is None:
            raise RuntimeError(f"{final} is not bound to an object store's settings")
        return s3.create_if_absent(final.store, str(final), data)
    temporary = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
    temporary.write_bytes(data)
    try:
        os.link(temporary, final)
    except FileExistsError:
        return False
    finally:
        temporary.unlink()
    return True


def arrow(location: Location) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem and path of `location` (for Parquet reads and writes)."""
    import pyarrow.fs as pafs

    if isinstance(location, ObjectPath):
        return location.filesystem, location.arrow_path
    return pafs.LocalFileSystem(), str(location)
