"""A secret given as a file (the batch server's, the object store's): its first line, read when
needed, with an error that names the setting and never the secret."""

from __future__ import annotations

from pathlib import Path

from duality.errors import UsageError


def first_line(path: Path, setting: str, what: str) -> str:
    """The first line of `path`, stripped (empty when the file is); a file that cannot be read
    is a UsageError naming `setting` (`NAME=path`) and `what` it should hold."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or type(error).__name__
        raise UsageError(
            f"{setting} cannot be read ({reason}): point it at the file holding {what}"
        ) from None
    return (text.strip().splitlines() or [""])[0].strip()
