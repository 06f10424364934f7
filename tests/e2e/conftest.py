"""One local stack (`duality up`: broker + Airflow standalone) for the end-to-end tests: the UI
test and the product tests use pipelines and topics of their own names, so they stay independent
while the stack's start is paid once."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from duality.config import SHIPPED_PIPELINES
from tests.harness import ROOT
from tests.stack import Stack, running_stack, stack_env


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The stack with the demo's pipelines and repartition config, as `make demo` has them,
    and an S3 server (`--object-store`) that holds its tables, checkpoints and reports: the
    demo's story runs with every location on object storage (issue #49)."""
    root = tmp_path_factory.mktemp("stack")
    env = stack_env(root)
    for setting in ("DUALITY_WAREHOUSE", "DUALITY_CHECKPOINT_ROOT", "DUALITY_REPORTS"):
        del env[setting]  # `up --object-store` puts them in its bucket
    for pipeline in ("product_sales", "regional_sales", "tier_sales"):
        shutil.copy(SHIPPED_PIPELINES / f"{pipeline}.yaml", root / "pipelines")
    shutil.copy(ROOT / "include" / "repartition.yaml", root / "repartition.yaml")
    with running_stack(root, env, "--object-store") as running:
        assert str(running.settings.warehouse).startswith("s3a://"), running.settings
        yield running
