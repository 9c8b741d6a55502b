"""How long a dead worker waits before it is started again (``app.pool.local``): the wait doubles
while it dies before it has loaded, up to a cap, and starts over once it had loaded."""

from __future__ import annotations

from types import SimpleNamespace

from app.pool.local import count_death, respawn_delay


def test_backoff_doubles_and_is_capped():
    assert [respawn_delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert respawn_delay(50) == 30.0


def test_a_worker_that_cannot_load_waits_longer_each_time_and_one_killed_after_loading_does_not():
    broken = SimpleNamespace(loaded=False, crashes_in_a_row=0)
    waits = []
    for _ in range(3):
        count_death(broken)
        waits.append(respawn_delay(broken.crashes_in_a_row))
    assert waits == [0.5, 1.0, 2.0]
    killed = SimpleNamespace(loaded=True, crashes_in_a_row=3)  # it had loaded: the kill says nothing of the next load
    count_death(killed)
    assert respawn_delay(killed.crashes_in_a_row) == 0.5
