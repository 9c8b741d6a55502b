"""Which engines start-up may serve on, from the flags and the architecture (``app.prepare``)."""

import pytest

from app.prepare import eligible_engines
from workers.spec import EngineKind


LEAN, ORT, HF = EngineKind.LEAN, EngineKind.ORT, EngineKind.HF


def supported() -> bool:
    return True


def unsupported() -> bool:
    return False


def never_asked() -> bool:
    raise AssertionError("the architecture was checked though the flags had already decided")


def test_by_default_the_lean_decoder_and_the_graph_are_measured_against_each_other():
    assert eligible_engines("auto", supported, "int8", "auto", "auto") == (LEAN, ORT)


@pytest.mark.parametrize("quantize, dtype, kernel", [("none", "auto", "auto"), ("int8", "bfloat16", "auto"),
                                                     ("int8", "auto", "fp16-fbgemm")])
def test_a_flag_that_restricts_the_kernels_leaves_the_graph_out(quantize, dtype, kernel):
    """The graph runs int8 throughout: it competes only where every choice is left to measurement."""
    assert eligible_engines("auto", supported, quantize, dtype, kernel) == (LEAN,)


def test_an_architecture_the_lean_decoder_lacks_runs_on_transformers():
    assert eligible_engines("auto", unsupported, "int8", "auto", "auto") == (HF,)
    assert eligible_engines("lean", unsupported, "int8", "auto", "auto") == (HF,)


def test_a_forced_engine_is_the_only_one():
    assert eligible_engines("ort", never_asked, "none", "float32", "fp32") == (ORT,)
    assert eligible_engines("hf", never_asked, "int8", "auto", "auto") == (HF,)
    assert eligible_engines("lean", supported, "int8", "auto", "auto") == (LEAN,)


@pytest.mark.parametrize("engine", ["auto", "ort"])
def test_4_bit_weights_are_the_graph_s_alone(engine):
    """Only the onnxruntime graph has 4-bit weights: ``--quantize int4`` serves on it, unmeasured."""
    assert eligible_engines(engine, never_asked, "int4", "auto", "auto") == (ORT,)
