"""The page's sampling controls as a crafted request sends them (gradio_client sends anything):
a value that is not a number in the control's range gets a message that names the control
and the range, never a Python error."""

from __future__ import annotations

import math

import pytest

from app.page.i18n import localize
from app.page.ui import control
from app.edge.validation import SAMPLING_RANGES, InvalidInput, check_number, check_params
from workers.protocol import SamplingParams

RANGES = {"temperature": "from 0 to 2", "top_p": "from 0.01 to 1", "top_k": "from 0 to 1000",
          "repetition_penalty": "from 1 to 2", "max_new_tokens": "from 1 to 2048"}
HOSTILE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "text": "abc", "digits": "7", "none": None,
           "list": [1], "dict": {"v": 1}, "bool": True, "1e30 int": 10**30, "1e300": 1e300, "below": -5,
           "5001 digits": 10**5000, "long text": "x" * 10_000}


def test_the_ranges_are_the_pages_and_the_apis():
    assert set(RANGES) == set(SAMPLING_RANGES)


@pytest.mark.parametrize("value", HOSTILE.values(), ids=HOSTILE.keys())
@pytest.mark.parametrize("name", sorted(RANGES))
def test_a_hostile_value_is_refused_naming_the_control_and_its_range(name, value):
    with pytest.raises(InvalidInput) as refused:
        check_number(name, value)
    message = str(refused.value)
    kind = "a whole number" if name in ("top_k", "max_new_tokens") else "a number"
    assert message.startswith(f"{name} must be {kind} {RANGES[name]}, not "), message
    assert len(message) < 120, message  # what the client sent is shown cut short


def test_a_crafted_page_request_gets_the_message_through_check_params():
    with pytest.raises(InvalidInput, match=r"^max_new_tokens must be a whole number from 1 to 2048, not nan\.$"):
        check_params(SamplingParams(max_new_tokens=math.nan, temperature=0.3))
    with pytest.raises(InvalidInput, match=r"^top_k must be a whole number from 0 to 1000, not 'abc'\.$"):
        check_params(SamplingParams(max_new_tokens=64, top_k="abc"))
    with pytest.raises(InvalidInput, match=r"^temperature must be a number from 0 to 2, not inf\.$"):
        check_params(SamplingParams(max_new_tokens=64, temperature=math.inf))


def test_values_in_range_pass_whole_numbers_rounded_and_the_rest_kept():
    sent = SamplingParams(max_new_tokens=512.0, temperature=0, top_p=1, top_k=49.6, repetition_penalty=1.05,
                          seed=7, stop=("END",), enable_thinking=False)
    checked = check_params(sent)
    assert checked == SamplingParams(max_new_tokens=512, temperature=0.0, top_p=1.0, top_k=50, repetition_penalty=1.05,
                                     seed=7, stop=("END",), enable_thinking=False)
    assert type(checked.max_new_tokens) is int and type(checked.top_k) is int and type(checked.temperature) is float
    for name, (low, high) in SAMPLING_RANGES.items():  # the ends are in range
        assert check_number(name, low) == low and check_number(name, high) == high


def test_the_message_is_shown_in_chinese_on_a_chinese_page():
    with pytest.raises(InvalidInput) as refused:
        check_number("top_k", math.nan)
    assert localize("zh", str(refused.value)) == "top_k 必须是 0 到 1000 之间的整数，而不是 nan。"
    with pytest.raises(InvalidInput) as refused:
        check_number("top_p", "x")
    assert localize("zh", str(refused.value)) == "top_p 必须是 0.01 到 1 之间的数，而不是 'x'。"


def test_the_pages_sliders_hand_over_what_was_sent():
    """Gradio's own check would refuse out of range without naming the slider, and fail on a
    string with a TypeError; the chat function's check names it."""
    slider = control(0, 1000, value=50, step=1, label="Top-k", render=False)
    for sent in ("abc", math.nan, 5000, None):
        assert slider.preprocess(sent) is sent
