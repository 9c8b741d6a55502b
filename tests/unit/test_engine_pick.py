"""``--engine auto``'s pick, on given timings (figures like those measured on Zen 3 and Zen 4):
the engine whose typical turn is faster serves, and the graph prompts on its fp32 twin only
where that is clearly faster and fits. (Measured for real: ``tests/test_engine_choice.py``.)"""

from __future__ import annotations

from workers.tuning.engine_choice import EngineTiming, pick, pick_prefill, twin_fits


def test_the_engine_with_the_faster_typical_turn_is_picked():
    lean = EngineTiming(prefill_ms=280.0, step_ms=38.0, batch_step_ms=48.0)  # Zen 4, Qwen1.5-0.5B shape
    ort = EngineTiming(prefill_ms=420.0, step_ms=21.0, batch_step_ms=40.0)
    assert pick({"lean": lean, "ort": ort}).engine == "ort"
    slow_batches = EngineTiming(prefill_ms=420.0, step_ms=21.0, batch_step_ms=90.0)  # faster alone only
    assert pick({"lean": lean, "ort": slow_batches}).engine == "lean"
    slow_prefill = EngineTiming(prefill_ms=4000.0, step_ms=21.0, batch_step_ms=40.0)  # a long wait for each reply
    assert pick({"lean": lean, "ort": slow_prefill}).engine == "lean"


def test_the_fp32_prefill_is_kept_only_where_clearly_faster_and_it_fits():
    """Its fp32 copy of the weights (~1.2 GB more on Qwen1.5-0.5B) must buy a prefill at most
    ``WIDER_PREFILL_GAIN`` of the int8 one's time (Zen 3: 0.67x at 512 tokens), and fit in
    half the memory available (one copy, mapped by every worker)."""
    assert pick_prefill({"same": 1041.0, "widen-fp32": 882.0}) == "widen-fp32"  # Zen 3, Qwen1.5-0.5B shape, 128 tokens
    assert pick_prefill({"same": 1000.0, "widen-fp32": 950.0}) == "same"  # 5% is not worth the memory
    assert pick_prefill({"same": 400.0, "widen-fp32": 620.0}) == "same"  # int8 GEMMs with VNNI
    assert pick_prefill({"same": 400.0}) == "same"
    gib = 2**30  # and only where it fits in half the memory available
    assert twin_fits(int(1.2 * gib), 20 * gib) and twin_fits(int(1.2 * gib), int(2.4 * gib))
    assert not twin_fits(int(1.2 * gib), 2 * gib) and not twin_fits(int(1.2 * gib), 0)
