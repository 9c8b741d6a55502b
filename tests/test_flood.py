"""A flood of huge requests while one normal chat streams, on one worker, as on a public Space
(the scenario: ``tests/flood.py``).

Throughout, /health must answer and the normal chat keep streaming, with times compared to
the same chat's own time per token measured alone in this test. Nine gaps in ten must stay
within the issue's 5x. The longest is held to 10x, twice the issue's target: on 2 cores a
single gap is at the mercy of whatever else the machine runs at that moment (the issue's
server froze at 1,569x). The target itself is a benchmark figure
(``benchmarks/flood_bench.py``, median and range over repeated floods: 2.2x, 2.0-3.5x).
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e import running_app
from tests.flood import ANSWERED, APP_ARGS, REFUSED, flood_body, run_flood


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with running_app(tmp_path_factory.mktemp("flood"), *APP_ARGS) as running:
        yield running


def test_a_flood_of_huge_requests_neither_freezes_health_nor_stalls_a_chat(app):
    assert len(flood_body(200)) > 2 * 2**20 > len(flood_body(60))
    run = run_flood(app.url)
    print(run.summary())
    assert run.statuses[:REFUSED] == [413] * REFUSED  # too large: refused before parsing
    assert run.statuses[REFUSED:] == [200] * ANSWERED, run.statuses  # answered, on what of the history fits
    assert run.p90_gap_s <= 5 * run.usual_gap_s, run.summary()
    assert run.longest_gap_s <= 10 * run.usual_gap_s, run.summary()
    assert max(run.health_s) <= 25 * run.usual_gap_s, run.summary()  # ~0.5 s, the bound
    assert httpx.get(app.url + "/health", timeout=10).json()["ready"]
