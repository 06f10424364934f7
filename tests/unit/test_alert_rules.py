"""monitoring/alerts.yml is a valid rules file, and each alert fires when it should and not
otherwise (`promtool test rules` on tests/unit/alerts_test.yml); a rule weakened or broken is
caught by those tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "monitoring" / "alerts.yml"
RULE_TESTS = Path(__file__).with_name("alerts_test.yml")


def _promtool(*arguments: str | Path) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: run `make monitoring` (Debian's prometheus)")
    command = [promtool, *map(str, arguments)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _alerts() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}


def test_the_rules_file_is_valid():
    checked = _promtool("check", "rules", RULES)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert _alerts() == {
        "DualityStreamDown",
        "DualityLagGrowing",
        "DualityDeadLettersHigh",
        "DualitySnapshotStale",
        "DualityValidationFailed",
        "DualityReplicaBehind",
    }


def test_each_alert_fires_and_stays_quiet_as_the_rule_tests_say():
    tested = _promtool("test", "rules", RULE_TESTS)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_each_alert_is_tested_firing_and_quiet():
    """Every alert has a case where it fires and one where it does not; every firing alert
    has its summary, which names the pipeline."""
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            alerts = check.get("exp_alerts") or []
            (firing if alerts else quiet).add(check["alertname"])
            for alert in alerts:
                pipeline = alert["exp_labels"]["pipeline"]
                assert pipeline in alert["exp_annotations"]["summary"], alert
    assert firing == quiet == _alerts()


# One change per rule that the rule tests must notice: each weakens or breaks one condition.
MUTATIONS = {
    "a dead stream no alert": (
        'max by (pipeline) (up{job="duality-streams"}) == 0',
        'max by (pipeline) (up{job="duality-streams"}) == -1',
    ),
    "a stalled stream alerting after 50 minutes": ("> 5 * 60", "> 50 * 60"),
    "a stream down without waiting records": (
        "sum by (pipeline) (duality_consumer_lag_records) > 0\n        for: 1m",
        "sum by (pipeline) (duality_consumer_lag_records) >= 0\n        for: 1m",
    ),
    "lag alerting when it falls": ("[10m:1m]) > 0", "[10m:1m]) < 0"),
    "lag alerting after 5 minutes": ("for: 10m", "for: 5m"),
    "dead letters alerting above 10%": ("> 0.05", "> 0.1"),
    "dead letters alerting above 1%": ("> 0.05", "> 0.01"),
    "a snapshot allowed 3 hours": ("> 2 * 3600", "> 3 * 3600"),
    "a replica alerting 100,000 records behind": (
        "(duality_replica_lag_records) > 10000",
        "(duality_replica_lag_records) > 100000",
    ),
    "a replica without Kafka no alert": (
        "(duality_replica_kafka_up) == 0",
        "(duality_replica_kafka_up) == -1",
    ),
    "a replica alerting at once": (
        "(duality_replica_kafka_up) == 0\n        for: 5m",
        "(duality_replica_kafka_up) == 0\n        for: 0m",
    ),
    "a passed validation alerting": (
        "duality_validation_success == 0",
        "duality_validation_success == 1",
    ),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_broken_rule_fails_the_rule_tests(mutation: str, tmp_path: Path):
    before, after = MUTATIONS[mutation]
    text = RULES.read_text()
    assert text.count(before) == 1, f"{before!r} is not once in {RULES}"
    mutated = tmp_path / "alerts.yml"
    mutated.write_text(text.replace(before, after))
    checked = _promtool("check", "rules", mutated)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tests = yaml.safe_load(RULE_TESTS.read_text())
    tests["rule_files"] = [str(mutated)]
    copy = tmp_path / "alerts_test.yml"
    copy.write_text(yaml.safe_dump(tests))
    tested = _promtool("test", "rules", copy)
    assert tested.returncode != 0, f"the rule tests pass with {mutation}"
