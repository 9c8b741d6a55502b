"""Which KV cache dtype serves (``workers.decoders.kv_choice``): the engine's own unless another,
close enough to it, is clearly faster; what each engine offers; what a forced one does."""

import pytest

from workers.decoders.kv_choice import GAIN, KL_BOUND, PREFILL_SLACK, KvTiming, candidates, forced, pick
from workers.spec import EngineSpec

pytestmark = pytest.mark.unit


def test_the_fastest_close_enough_cache_serves():
    timings = {"float32": KvTiming(20.0, 30.0, 60.0, 0.0), "int8": KvTiming(19.0, 24.0, 40.0, 0.006)}
    assert pick(timings) == "int8"


def test_a_reply_step_is_half_alone_over_both_contexts_half_in_a_full_batch():
    assert KvTiming(20.0, 30.0, 60.0, 0.0).step_ms == (25.0 + 60.0) / 2


def test_the_engines_own_cache_serves_unless_another_is_clearly_faster():
    own = KvTiming(20.0, 30.0, 60.0, 0.0)
    barely = KvTiming(own.short_ms, own.long_ms, own.batch_ms - 2 * (1 - GAIN) * own.step_ms + 0.1, 0.0)
    assert barely.step_ms > GAIN * own.step_ms > barely.step_ms - 0.1
    assert pick({"float32": own, "int8": barely}) == "float32"
    assert pick({"float32": own, "int8": KvTiming(30.0, 40.0, 80.0, 0.0)}) == "float32"


def test_a_cache_that_slows_a_long_conversations_next_turn_is_not_kept_however_fast_it_steps():
    """Zen 5's figures: onnxruntime's int8 cache steps faster, but prefills a next turn 1.75x slower."""
    own = KvTiming(10.4, 13.2, 29.7, 0.0, prefill_ms=411.0)
    assert pick({"float32": own, "int8": KvTiming(10.1, 12.2, 22.2, 0.002, prefill_ms=719.0)}) == "float32"
    within = KvTiming(10.1, 12.2, 22.2, 0.002, prefill_ms=PREFILL_SLACK * own.prefill_ms - 1)
    assert pick({"float32": own, "int8": within}) == "int8"
    assert "256 tokens on 1024 411 ms" in own.summary()


def test_a_cache_too_far_from_the_engines_own_is_never_kept_however_fast():
    timings = {"float32": KvTiming(20.0, 30.0, 60.0, 0.0), "bfloat16": KvTiming(10.0, 12.0, 30.0, KL_BOUND * 2),
               "float16": KvTiming(18.0, 26.0, 50.0, KL_BOUND / 2)}
    assert pick(timings) == "float16"


def test_each_engine_offers_its_own_cache_first_then_smaller_ones():
    assert candidates(EngineSpec.ort("m", "g")) == ("float32", "int8")
    assert candidates(EngineSpec.lean("m", "w", "int8-ort")) == ("float32", "bfloat16", "float16")
    assert candidates(EngineSpec.lean("m", "w", "int8pack-bf16", dtype="bfloat16")) == ("bfloat16",)
    assert candidates(EngineSpec.hf("m")) == ()


def test_a_forced_dtype_the_engine_keeps_is_used_and_said_and_another_is_not():
    assert forced(EngineSpec.ort("m", "g"), "int8").kv == "int8"
    assert "KV cache int8 (forced)" in forced(EngineSpec.ort("m", "g"), "int8").summary
    assert forced(EngineSpec.ort("m", "g"), "bfloat16").kv is None  # the graph keeps no bfloat16 cache
    assert forced(EngineSpec.lean("m", "w", "int8-ort"), "int8").kv is None
    assert forced(EngineSpec.lean("m", "w", "int8-ort"), "float32").kv is None  # its own
