"""The logs of the local stack's daemons, as quoted in the error of one that failed."""

from __future__ import annotations

from pathlib import Path


def tail(*logs: Path, lines: int = 25) -> str:
    """The last `lines` lines of the `logs` that exist, for the error of a daemon that failed."""
    texts = []
    for path in logs:
        if path.is_file():
            texts.extend(path.read_text(errors="replace").splitlines()[-lines:])
    return "\n".join(texts[-lines:]) or "(no log output)"
