"""One three-node KRaft cluster for the system tests that need one: each uses topics and groups
of its own names, so they stay independent while the cluster's start is paid once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from duality.config import Settings
from duality.local.kraft import LocalKafkaCluster, ephemeral_cluster


@pytest.fixture(scope="package")
def cluster(base_settings: Settings) -> Iterator[LocalKafkaCluster]:
    with ephemeral_cluster(base_settings, brokers=3) as started:
        yield started
