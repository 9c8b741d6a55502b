"""The prompts the README and the API docs show a newcomer are ones the tests check the bundled
model answers right on every kernel (``tests.asks``; ``tests/test_kernels.py``), or, for a tool
call, the one ``tests/test_tools.py`` checks."""

import re
from pathlib import Path

import pytest

from tests.asks import CAPITAL, WEATHER

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", ["README.md", "docs/api.md"])
def test_every_example_prompt_in_the_docs_is_one_with_a_checked_answer(doc):
    text = (ROOT / doc).read_text()
    prompts = re.findall(r'"content":\s*"([^"]+)"', text)
    assert prompts, f"{doc} shows no example prompt"
    assert set(prompts) <= {CAPITAL, WEATHER} and CAPITAL in prompts, prompts
