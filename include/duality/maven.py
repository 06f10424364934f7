"""Artifacts fetched from Maven Central when first needed (the S3A jars, the schema registry's
runner): one `mvn dependency:copy` each, which needs no project of its own."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from duality.errors import LocalStackError, UsageError


def copy(artifact: str, folder: Path) -> None:
    """`artifact` (`group:name:version[:type[:classifier]]`) copied into `folder`; without Maven
    a UsageError naming the fix, and a LocalStackError with the end of Maven's output when the
    copy fails."""
    if shutil.which("mvn") is None:
        raise UsageError("mvn is not installed: install Maven (apt-get install maven)")
    done = subprocess.run(
        [
            "mvn",
            "--quiet",
            "--batch-mode",
            "-Dstyle.color=never",
            "dependency:copy",
            f"-Dartifact={artifact}",
            f"-DoutputDirectory={folder}",
        ],
        capture_output=True,
        text=True,
        cwd=folder,
    )
    if done.returncode != 0:
        raise LocalStackError(
            f"could not fetch {artifact} from Maven Central:\n"
            + (done.stdout + done.stderr)[-2000:]
        )
