"""The rule that picks a worker layout from its timings (``workers.tuning.layout_choice.pick``)."""

import pytest

from workers.tuning.layout_choice import LayoutTiming, candidates, pick


def timing(workers: int, threads: int, alone_tok_s: float, aggregate_tok_s: float, streams: int = 4):
    per_worker = -(-streams // workers)
    step = per_worker * 1000 / (aggregate_tok_s / workers)
    return LayoutTiming(workers, threads, 1000 / alone_tok_s, (step,) * workers, streams, (500.0,) * workers)


def test_every_even_split_up_to_four_workers_is_a_candidate():
    assert candidates(1) == [(1, 1)]
    assert candidates(2) == [(1, 2), (2, 1)]
    assert candidates(6) == [(1, 6), (2, 3), (3, 2)]
    assert candidates(8) == [(1, 8), (2, 4), (4, 2)]


def test_the_aggregate_is_what_every_worker_serves_together():
    t = timing(2, 1, 30, 80)
    assert t.aggregate_tok_s == pytest.approx(80)
    assert t.single_tok_s == pytest.approx(30)


def test_the_best_aggregate_wins_where_its_stream_alone_keeps_up():
    choice = pick([timing(1, 2, 41, 70), timing(2, 1, 39, 94)])
    assert (choice.workers, choice.threads) == (2, 1)
    assert "best aggregate" in choice.why


def test_a_faster_crowd_does_not_make_the_lone_user_wait():
    """As measured on a 2-core Zen 4: 41 vs 28 tok/s alone; 2×1 serves four streams faster
    here, but its lone stream is 32% slower than one worker's on both cores."""
    choice = pick([timing(1, 2, 41, 82), timing(2, 1, 28, 94)])
    assert (choice.workers, choice.threads) == (1, 2)
    assert "2×1 serves 4 streams faster" in choice.why and "32% slower" in choice.why


def test_a_tie_goes_to_fewer_workers():
    assert pick([timing(1, 2, 40, 90), timing(2, 1, 40, 90)]).workers == 1


def test_a_timing_in_doubt_is_reported_untrusted():
    doubted = LayoutTiming(2, 1, 25.0, (40.0, 40.0), 4, (500.0, 500.0), ("worker 1 loaded: busy",))
    choice = pick([timing(1, 2, 40, 90), doubted])
    assert not choice.trusted and choice.report()["doubts"] == ["worker 1 loaded: busy"]
