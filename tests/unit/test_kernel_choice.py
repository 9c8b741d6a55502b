"""Which linear kernels serve, on given timings (shaped like the Zen 3 and Zen 4 figures
measured per layer): the fastest typical turn that is accurate, available and allowed by the
flags. (That the one chosen here really is faster here: ``tests/test_kernels.py``.)"""

from __future__ import annotations

import pytest

from workers.tuning.kernel_choice import Allowed, CalibrationError, Measurement, Timing, choose

AVX2 = {  # ms per layer, shaped like the Zen 3 figures in the issue (bf16 GEMMs emulated)
    ("fp32", "decode-1", "decode"): 3.3, ("fp32", "decode-4", "decode"): 6.0, ("fp32", "prefill-128", "same"): 22.0,
    ("bf16", "decode-1", "decode"): 0.78, ("bf16", "decode-4", "decode"): 2.6, ("bf16", "prefill-128", "same"): 75.0,
    ("fp16-fbgemm", "decode-1", "decode"): 0.84, ("fp16-fbgemm", "decode-4", "decode"): 0.88,
    ("fp16-fbgemm", "prefill-128", "same"): 16.6,
    ("int8pack-bf16", "decode-1", "decode"): 0.92, ("int8pack-bf16", "decode-4", "decode"): 1.39,
    ("int8pack-bf16", "prefill-128", "widen-bf16"): 76.0, ("int8pack-bf16", "prefill-128", "widen-fp32"): 31.0,
    ("int8pack-fp32", "decode-1", "decode"): 5.5, ("int8pack-fp32", "decode-4", "decode"): 21.7,
    ("int8-ort", "decode-1", "decode"): 0.55, ("int8-ort", "decode-4", "decode"): 0.80,
    ("int8-ort", "prefill-128", "ort-fp32"): 19.8, ("int8-ort", "prefill-128", "widen-fp32"): 30.0,
}


def measured(times: dict, errors: dict | None = None, unavailable_: dict | None = None) -> Measurement:
    timings = tuple(Timing(k, phase, path, ms, 10.0) for (k, phase, path), ms in times.items())
    default_errors = {f"{k}/{path}": 0.01 for (k, _, path) in times}
    default_errors.update({f"{k}/decode": 0.01 for (k, _, _) in times})
    return Measurement("test CPU", 4, timings, {**default_errors, **(errors or {})}, unavailable_ or {}, 1.0)


def test_choice_on_an_avx2_machine_is_onnxruntime_int8_and_never_a_slow_combination():
    choice = choose(measured(AVX2), Allowed())
    assert (choice.decode, choice.prefill, choice.dtype) == ("int8-ort", "ort-fp32", "float32")
    assert choice.why == "measured fastest"


def test_choice_respects_the_flags():
    m = measured(AVX2)
    assert choose(m, Allowed(int8=False)).decode == "fp16-fbgemm"  # --quantize none: no int8
    bf16 = choose(m, Allowed(dtype="bfloat16"))  # --dtype bfloat16: the bf16-activation kernels only
    assert (bf16.decode, bf16.prefill) == ("int8pack-bf16", "widen-fp32")  # emulated bf16 GEMMs are slower
    forced = choose(m, Allowed(kernel="fp32"))
    assert (forced.decode, forced.why) == ("fp32", "forced with --kernel")


def test_an_inaccurate_or_unavailable_kernel_is_never_chosen():
    assert choose(measured(AVX2, errors={"int8-ort/decode": 0.2}), Allowed()).decode == "fp16-fbgemm"
    assert choose(measured(AVX2, errors={"int8-ort/ort-fp32": 0.2}), Allowed()).decode == "fp16-fbgemm"  # no exact prefill
    no_ort = measured({k: v for k, v in AVX2.items() if k[0] != "int8-ort"}, unavailable_={"int8-ort": "not installed"})
    assert choose(no_ort, Allowed()).decode == "fp16-fbgemm"
    with pytest.raises(CalibrationError, match="cannot run here"):
        choose(no_ort, Allowed(kernel="int8-ort"))
    with pytest.raises(CalibrationError, match="no kernel fits"):
        choose(measured({k: v for k, v in AVX2.items() if k[0] == "int8-ort"}), Allowed(int8=False))


def test_choice_on_a_bf16_machine_takes_whatever_is_fastest_there():
    zen4 = {("fp32", "decode-1", "decode"): 3.3, ("fp32", "decode-4", "decode"): 6.4,
            ("int8pack-bf16", "decode-1", "decode"): 0.45, ("int8pack-bf16", "decode-4", "decode"): 0.5,
            ("int8pack-bf16", "prefill-128", "widen-bf16"): 9.6, ("int8pack-bf16", "prefill-128", "widen-fp32"): 24.0,
            ("int8-ort", "decode-1", "decode"): 0.70, ("int8-ort", "decode-4", "decode"): 0.96}
    choice = choose(measured(zen4), Allowed())
    assert (choice.decode, choice.prefill, choice.dtype) == ("int8pack-bf16", "widen-bf16", "bfloat16")


def test_a_kernel_that_decodes_faster_but_prefills_far_slower_loses():
    """Time to first token counts too: a typical turn prefills 256 tokens and decodes 256."""
    times = {("int8pack-bf16", "decode-1", "decode"): 0.8, ("int8pack-bf16", "decode-4", "decode"): 1.0,
             ("int8pack-bf16", "prefill-128", "widen-bf16"): 10.0,
             ("int8-ort", "decode-1", "decode"): 0.6, ("int8-ort", "decode-4", "decode"): 0.8,
             ("int8-ort", "prefill-128", "ort-fp32"): 100.0}
    assert choose(measured(times), Allowed()).decode == "int8pack-bf16"
    times[("int8-ort", "prefill-128", "ort-fp32")] = 20.0
    assert choose(measured(times), Allowed()).decode == "int8-ort"


def test_a_choice_says_how_far_ahead_of_the_runner_up_it_is_and_when_that_is_within_the_noise():
    """A typical turn: 256 prompt tokens (2 prefills of 128) and 256 steps, half alone, half batched."""
    fp32 = {("fp32", "decode-1", "decode"): 2.0, ("fp32", "decode-4", "decode"): 4.0,
            ("fp32", "prefill-128", "same"): 10.0}  # a turn: 2 x 10 + 256 x 3 = 788 ms a layer
    clear = choose(measured({**fp32, ("bf16", "decode-1", "decode"): 1.0, ("bf16", "decode-4", "decode"): 2.0,
                             ("bf16", "prefill-128", "same"): 5.0}), Allowed())  # 394 ms
    assert (clear.decode, clear.lead.runner_up, clear.lead.clear) == ("bf16", "fp32", True)
    assert clear.lead.ratio == pytest.approx(2.0) and "(measured fastest, 2.00x ahead of fp32)" in clear.summary()
    close = choose(measured({**fp32, ("bf16", "decode-1", "decode"): 1.9, ("bf16", "decode-4", "decode"): 3.8,
                             ("bf16", "prefill-128", "same"): 9.5}), Allowed())  # 748.6 ms: 5% ahead
    assert close.decode == "bf16" and not close.lead.clear
    assert close.report()["lead"] == {"runner_up": "fp32", "ratio": 1.053, "clear": False}
    assert "within the timings' precision of fp32 (1.05x)" in close.summary()
    assert choose(measured(fp32), Allowed(kernel="fp32")).lead is None  # forced: no contest
