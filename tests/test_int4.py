"""``--quantize int4``: the graph's 4-bit weights, opt-in, with their price stated at start.

The measurement first (``workers.tuning.perplexity``), on the bundled model's real weights: it
must tell the int8 graph (within the 2% the app promises for it) from the 4-bit one. Then the
app end to end: it serves on the 4-bit graph, says what it measured in the log, on /health and
on the page's panel, and answers.
"""

from __future__ import annotations

import httpx
import pytest
from gradio_client import Client

from tests.asks import CAPITAL
from tests.e2e import running_app
from tests.test_ort_engine import ort_graph  # noqa: F401 - a fixture
from workers.decoders.ort.decoder import OrtDecoder
from workers.decoders.ort.graph import build, weights
from workers.tuning import perplexity


@pytest.fixture(scope="module")
def int4_graph(bundled_model, cache_dir):
    return build(bundled_model.path, cache_dir, weights("int4"))


def test_the_measurement_tells_int8_from_4_bit_weights(bundled_model, ort_graph, int4_graph):  # noqa: F811
    from transformers import AutoTokenizer

    pieces = perplexity.windows(perplexity.text_ids(AutoTokenizer.from_pretrained(bundled_model.path)))
    reference, scored = perplexity.of(perplexity.reference_nlls(bundled_model.path, pieces))
    int8, int4 = (perplexity.of(perplexity.graph_nlls(OrtDecoder(str(g), 2, halves=False), pieces))[0]
                  for g in (ort_graph, int4_graph))
    assert scored > 1500
    assert 5 < reference < 100  # the model predicts its text: not a uniform guess over 49,152 tokens
    assert abs(int8 / reference - 1) < 0.02
    assert int4 / reference - 1 > 0.02 + (int8 / reference - 1)


def test_the_app_serves_4_bit_weights_and_states_their_price(tmp_path, int4_graph):
    with running_app(tmp_path, "--quantize", "int4", "--workers", "1", "--threads-per-worker", "2",
                     ready_timeout_s=600) as app:
        health = app.health()
        quality = health["quality"]
        assert quality["tokens"] > 1500 and quality["graph"] > quality["reference"] * 1.02
        rise = f"{100 * (quality['graph'] / quality['reference'] - 1):+.1f}%"
        assert all("int4 MatMulNBits" in w["kernels"] and rise in w["kernels"] for w in health["workers"])
        assert f"--quantize int4: perplexity {quality['graph']:.2f} against {quality['reference']:.2f}" in app.log()
        panel = Client(app.url + "/", verbose=False).predict(api_name="/panel")
        assert f"**{rise}**" in panel and "4-bit in blocks of 32" in panel, panel
        reply = httpx.post(f"{app.url}/v1/chat/completions", timeout=300, json={
            "model": "any", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": CAPITAL}]}).json()
        assert "Paris" in reply["choices"][0]["message"]["content"]
