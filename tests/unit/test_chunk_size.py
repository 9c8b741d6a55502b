"""How many prompt tokens a chunk takes beside the other replies' decode steps
(``workers.scheduler.chunk_size.ChunkSize``), on given step and chunk costs: chunks grow to
the largest that keeps the others' wait within the budget, shrink as tokens cost more along
the prompt, and one stalled step does not stretch them. (On a real worker:
``tests/test_chunked_prefill.py``.)"""

from __future__ import annotations

from collections import deque

from workers.scheduler.chunk_size import AloneChunk, ChunkSize


def run_chunks(chunk: ChunkSize | AloneChunk, cost, prompt_tokens: int) -> list[tuple[int, float]]:
    """Prefill ``prompt_tokens`` in chunks sized by ``chunk``; cost(position, tokens) -> seconds."""
    done, ran = 0, []
    while done < prompt_tokens:
        n = min(chunk.tokens, prompt_tokens - done)
        seconds = cost(done, n)
        chunk.update(n, seconds)
        ran.append((n, seconds))
        done += n
    return ran


def test_chunks_grow_to_the_largest_that_fits_the_budget_and_never_overshoot_on_the_way():
    chunk = ChunkSize(steps=deque([0.030]))  # a decode step; a chunk costs one step's weights pass + 3 ms a token
    ran = run_chunks(chunk, lambda position, n: 0.030 + 0.003 * n, 200)
    budget = chunk.budget_steps * chunk.step_s
    assert [n for n, _ in ran[:4]] == [1, 2, 4, 5]  # doubling, then the fit: (45 - 30) / 3 = 5 tokens
    assert chunk.tokens == 5
    assert all(seconds <= budget + 1e-9 for _, seconds in ran)


def test_chunks_shrink_as_the_cost_per_token_grows_along_the_prompt():
    chunk = ChunkSize(steps=deque([0.030]))
    ran = run_chunks(chunk, lambda position, n: 0.030 + (0.002 + position * 0.00001) * n, 1000)  # 2 -> 12 ms a token
    budget = chunk.budget_steps * chunk.step_s
    assert max(n for n, _ in ran[:20]) >= 5 and chunk.tokens == 1  # 7 tokens fit at the start, 1 by the end
    over = [seconds for _, seconds in ran if seconds > budget]
    assert len(over) <= len(ran) // 10 and max(over, default=0) <= 1.1 * budget  # the fit lags a little


def test_one_slow_decode_step_does_not_stretch_the_chunks():
    """The budget is in the median of the latest plain steps: a step the VM stalled (here the
    last before the prompt, 2x) does not let every chunk of the prompt grow by half."""
    chunk = ChunkSize(fused=True)
    for seconds in [0.030] * 8 + [0.060]:
        chunk.record_step(seconds)
    assert chunk.step_s == 0.030
    run_chunks(chunk, lambda position, n: 0.030 + 0.003 * n, 200)
    assert chunk.tokens == 15  # as with every step at 30 ms: 1.5 x 30 / 3


def test_a_chunk_needs_a_decode_step_to_measure_against():
    chunk = ChunkSize()  # nobody decoding yet: no step to size chunks by
    chunk.update(1, 0.5)
    assert chunk.tokens == 1 and not chunk.timed


def test_a_chunk_in_the_decode_steps_call_may_cost_the_budget_beside_the_step():
    chunk = ChunkSize(fused=True, steps=deque([0.030]))  # the call: the step's 30 ms plus 3 ms a prompt token
    ran = run_chunks(chunk, lambda position, n: 0.030 + 0.003 * n, 200)
    assert [n for n, _ in ran[:5]] == [1, 2, 4, 8, 15]  # doubling, then the fit: 1.5 x 30 / 3 = 15 tokens
    assert all(seconds <= (1 + chunk.budget_steps) * chunk.step_s + 1e-9 for _, seconds in ran)


def test_a_prompt_alone_goes_in_calls_of_about_the_target_on_a_slow_cpu_too():
    for per_token in (0.0005, 0.004, 0.02):  # a fast CPU, a slow one, one core of a Zen 3 on the 0.5B shape
        chunk = AloneChunk()
        ran = run_chunks(chunk, lambda position, n: 0.02 + (per_token + position * 1e-7) * n, 4000)
        assert max(seconds for _, seconds in ran[1:]) <= 1.2 * chunk.target_s, (per_token, ran)  # after the guess
        total_s = sum(seconds for _, seconds in ran)
        assert len(ran) <= total_s / (0.5 * chunk.target_s) + 5, (per_token, ran)  # not crumbs: few weight passes


def test_a_prompt_alone_that_fits_one_call_is_one_call():
    chunk = AloneChunk()
    assert run_chunks(chunk, lambda position, n: 0.02 + 0.002 * n, 200) == [(200, 0.02 + 0.002 * 200)]
    assert chunk.tokens == 256  # a short prompt's call is not counted: it says little of the cost per token


def test_calls_alone_grow_at_most_twofold_so_a_first_guess_cannot_overshoot():
    chunk = AloneChunk()
    ran = run_chunks(chunk, lambda position, n: 0.0001 * n, 10_000)
    assert [n for n, _ in ran[:4]] == [256, 512, 1024, 2048]
