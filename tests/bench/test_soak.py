"""`arbiter bench soak`: its traffic, its verdict, and a few seconds of it against a live server
(a fake engine; `make soak` runs it on the real model)."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
from pathlib import Path

from adapter.app import create_app
from arbiter.settings import ServerSettings
from bench import soak
from bench.served import Served, metric
from tests.fakes import FakeEngine
from tests.live_server import serve


def test_every_kind_is_sent_and_the_hostile_ones_vary() -> None:
    traffic = soak.Traffic(states=300, rng=random.Random(0))
    calls = [traffic.make() for _ in range(2000)]
    assert {c.kind for c in calls} == set(soak.BUILDERS)
    hostile = {c.body[:40] for c in calls if c.kind == "hostile"}
    assert len(hostile) >= 6
    assert len({c.body for c in calls if c.kind == "single"}) > 200  # the cache churns


def test_the_growth_bound_and_the_slope() -> None:
    assert soak.allowed_growth_mb(100, 8.0, 16.0) == 16.0
    assert soak.allowed_growth_mb(4000, 8.0, 16.0) == 32.0
    flat = [soak.Sample(t, t * 10, 800.0 + (t % 2) * 0.5, 14, 0.0) for t in range(30)]
    assert abs(soak._slope_per_1k(flat)) < 1.0
    leak = [soak.Sample(t, t * 10, 800.0 + t, 14, 0.0) for t in range(30)]
    assert 99 < soak._slope_per_1k(leak) < 101  # 1 MB per 10 requests
    assert soak._growth_mb(leak) > 20


def test_metric_reads_one_labelled_sample() -> None:
    text = 'a_total{stage="computing"} 3.0\na_total{stage="queued"} 1.0\nb 7.0\n'
    assert metric(text, "a_total", stage="queued") == 1.0
    assert metric(text, "b") == 7.0 and metric(text, "c") is None


def test_a_short_soak_against_a_live_server(tmp_path: Path) -> None:
    app = create_app(
        ServerSettings(max_in_flight=1, max_queue=8), lambda: FakeEngine(0.01, max_options=255)
    )
    log = tmp_path / "serve.log"
    log.write_text("")
    args = argparse.Namespace(
        minutes=0.1,
        clients=3,
        states=50,
        prefix_cache_mb=32.0,
        sample_s=1.0,
        seed=0,
        max_growth_mb_per_1k=8.0,
        max_growth_mb=64.0,
        max_fd_growth=64,
    )
    with serve(app) as base:
        summary = asyncio.run(soak._soak(Served(base, os.getpid(), log), args))
    assert summary["requests"] > 20 and summary["5xx"] == 0
    assert summary["healthy_after"]
    for kind, counts in summary["statuses"].items():
        if kind == "hostile":
            assert all(status.startswith("4") for status in counts), counts
        elif kind == "leaving":
            assert set(counts) <= {"left", "200"}, counts
        else:
            assert set(counts) == {"200"}, (kind, counts)
