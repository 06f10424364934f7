"""Pull queries of a running stream: two replicas (`duality serve`) equal the changelog's latest
values (read with a plain consumer, read committed); under a steady load a client that sends
back the last token it got never gets an older answer, from either replica; `duality query`
answers from the other replica when one is SIGKILLed."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from duality import workload
from duality.config import Settings
from duality.serve.keys import parse_token, reached, token
from duality.spec import PipelineSpec
from tests.harness import (
    SteadyLoad,
    StreamProcess,
    assert_eventually,
    make_pipeline,
    read_latest,
    run_duality,
)
from tests.serving import ServeProcess, stable_ends


def _assert_equal(replica: ServeProcess, spec: PipelineSpec, truth: dict[bytes, Any]) -> None:
    """Every key of the changelog has its latest value at the replica, and a key of none 404."""
    for key, value in truth.items():
        status, body = replica.row(spec.name, key.decode())
        assert status == 200 and body["row"] == value, (key, body)
    assert replica.row(spec.name, "no-such-product")[0] == 404


def test_replicas_of_a_running_stream(settings: Settings, tmp_path: Path):
    pipelines = tmp_path / "pipelines"
    spec = make_pipeline(settings, pipelines, "product_sales")
    scoped = settings.replace(pipelines=pipelines)
    workload.produce(settings, spec, events=3_000, keys=200, seed=3)
    stream = StreamProcess(settings, spec, pipelines, tmp_path / "stream.log")
    first = ServeProcess(scoped, tmp_path / "first", spec.name)
    second = ServeProcess(scoped, tmp_path / "second", spec.name)
    load = SteadyLoad(settings, spec, rate=200, keys=200, seed=11)
    try:
        stream.start()
        first.start()
        second.start()
        stream.wait_caught_up()
        ends = stable_ends(settings, spec.changelog_topic)
        truth = read_latest(settings, spec)
        for replica in (first, second):
            assert_eventually(lambda r=replica: r.caught_up(spec.name, ends), timeout=120)  # type: ignore[misc]
            _assert_equal(replica, spec, truth)
        both = scoped.replace(replicas=f"{first.url},{second.url}")
        key = next(iter(truth)).decode()
        done = run_duality(both, "query", spec.name, key, "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["row"] == truth[key.encode()]
        print(run_duality(both, "query", spec.name, key).stdout)  # the README's example

        # Under load, a client sending back the newest token it got never reads older.
        load.start()
        keys = [k.decode() for k in truth]
        newest: dict[int, int] = {}
        seen: dict[str, int] = {}  # the newest changelog offset read per key
        answers = refused = 0
        chance = random.Random(5)
        while answers < 150:
            replica = (first, second)[answers % 2]
            key = chance.choice(keys)
            status, body = replica.row(
                spec.name, key, at=token(spec.changelog_topic, newest), wait=5
            )
            if status == 503:
                refused += 1
                assert refused < 20, body
                continue
            assert status == 200, body
            position = parse_token(body["token"], spec.changelog_topic)
            assert reached(position, newest), (position, newest)
            assert body["offset"] >= seen.get(key, -1), (key, body, seen.get(key))
            seen[key] = body["offset"]
            newest = {p: max(o, newest.get(p, 0)) for p, o in position.items()}
            answers += 1

        # One replica SIGKILLed under the load: `duality query` answers from the other.
        first.kill()
        newest_token = token(spec.changelog_topic, newest)
        for key in keys[:5]:
            done = run_duality(
                both, "query", spec.name, key, "--at", newest_token, "--wait", "10", "--json"
            )
            assert done.returncode == 0, done.stderr
            answer = json.loads(done.stdout)
            assert answer["replica"] == second.url
            assert reached(parse_token(answer["token"], spec.changelog_topic), newest)
        load.stop()
        stream.wait_caught_up()
        ends = stable_ends(settings, spec.changelog_topic)
        assert_eventually(lambda: second.caught_up(spec.name, ends), timeout=120)
        _assert_equal(second, spec, read_latest(settings, spec))
        assert stream.stop() == 0
        second.stop()
    finally:
        if load.is_alive():
            load.stopping.set()
        for replica in (first, second):
            replica.kill()
        stream.kill()
