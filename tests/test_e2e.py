"""The real app as a user starts it: launch.py, the Gradio client, the OpenAI SDK, signals."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest
from gradio_client import Client
from prometheus_client.parser import text_string_to_metric_families

from tests.asks import CAPITAL, EXAMPLE_ANSWERS, LINES, QUOTED
from tests.e2e import running_app, wait_gone

GREEDY_UI = dict(system="", temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0, max_new_tokens=64)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    # The default model id, as a new user would run it: the hub is unreachable, so the app
    # must fall back to the bundled model on its own.
    with running_app(tmp_path_factory.mktemp("app"), "--workers", "2", "--threads-per-worker", "1",
                        "--oversubscribe") as running:
        yield running


def test_health_reports_model_fallback_and_worker_layout(app):
    health = app.health()
    assert health["ready"] is True
    assert health["model_source"] == "bundled" and "cannot be reached" in health["model_reason"]
    assert [w["id"] for w in health["workers"]] == [0, 1]
    for w in health["workers"]:
        assert w["threads"] == 1 and w["state"] == "idle" and w["pid"] > 0
    assert "serving the bundled offline model" in app.log()


def test_page_names_the_model_and_why(app):
    page = httpx.get(app.url + "/", timeout=10)
    assert page.status_code == 200
    banner = Client(app.url + "/", verbose=False).predict(api_name="/banner")  # the text atop the page
    assert "SmolLM2-135M-Instruct" in banner and "cannot be reached" in banner


def test_gradio_client_streams_a_reply(app):
    client = Client(app.url + "/", verbose=False)
    ask = "Explain photosynthesis in one sentence."  # a reply of ~30 tokens: a 7-token one (CAPITAL) came
    # in two updates at 100 tokens/s on Zen 5, the stream merged by the time the client read it
    job = client.submit(ask, *GREEDY_UI.values(), api_name="/chat")
    outputs = list(job)
    assert len(outputs) > 2, "the reply should arrive in several streamed updates"
    assert EXAMPLE_ANSWERS[ask] in outputs[-1]
    assert "tokens/s" in outputs[-1]  # the stats footer under the answer
    assert len(outputs[0]) < len(outputs[-1])


def test_openai_sdk_streams_with_usage_and_metrics(app):
    client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused")
    assert client.models.list().data[0].id.startswith("SmolLM2")
    chunks, arrivals = [], []  # arrivals: when each piece of text came
    began = time.monotonic()
    for chunk in client.chat.completions.create(model="any", messages=[{"role": "user", "content": CAPITAL}],
                                                stream=True, stream_options={"include_usage": True},
                                                temperature=0.0, max_tokens=48):
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
    ended = time.monotonic()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    *_, finish, last = chunks  # as OpenAI's: the finish reason, then the usage in a chunk of its own
    assert finish.choices[0].finish_reason == "stop" and last.choices == []
    assert all(c.usage is None for c in chunks[:-1])
    assert last.usage.completion_tokens >= len(arrivals) > 2  # it streams, a token or more a piece
    metrics = finish.model_extra["metrics"]
    assert metrics["worker"] in (0, 1)
    # the time to first token and the tokens/s it reports are this reply's: within what the client saw
    assert 0 < metrics["ttft_ms"] / 1000 <= arrivals[0] - began, (metrics, arrivals[0] - began)
    decode_s = (last.usage.completion_tokens - 1) / metrics["decode_tokens_per_s"]
    assert decode_s <= ended - began, (metrics, ended - began)
    unasked = list(client.chat.completions.create(model="any", messages=[{"role": "user", "content": CAPITAL}],
                                                  stream=True, temperature=0.0, max_tokens=4))
    assert all(c.usage is None and c.choices for c in unasked)  # no usage, as OpenAI's, unless asked for
    assert unasked[-1].choices[0].finish_reason == "length" and "metrics" in unasked[-1].model_extra


def test_openai_non_stream_and_bad_input(app):
    client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": CAPITAL}], temperature=0.0,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.model_extra["metrics"]["prompt_tokens"] == reply.usage.prompt_tokens
    bad = httpx.post(app.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                              "temperature": 9}, timeout=10)
    assert bad.status_code == 422 and "temperature" in bad.text
    assert app.health()["ready"]


def test_openai_sdk_fields_are_honoured_or_refused_by_name(app):
    """What the official SDK and common frontends send: honoured, or a 400 that names it."""
    client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
    ask = dict(model="any", temperature=0.0, max_tokens=48)
    counting = [{"role": "user", "content": LINES}]
    full = client.chat.completions.create(messages=counting, **ask).choices[0]
    assert "\n" in full.message.content.strip()
    stopped = client.chat.completions.create(messages=counting, stop=["\n"], **ask).choices[0]
    assert "\n" not in stopped.message.content and stopped.finish_reason == "stop"
    assert full.message.content.startswith(stopped.message.content)
    parts = [{"role": "developer", "content": "Answer in one word."},
             {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    assert "Paris" in client.chat.completions.create(messages=parts, **ask).choices[0].message.content
    refused = {"functions": {"extra_body": {"functions": [{"name": "f"}]}},  # the deprecated spelling of tools
               "top_logprobs": {"top_logprobs": 2}}  # without logprobs=True, as OpenAI's
    for field, extra in refused.items():
        with pytest.raises(openai.BadRequestError, match=field):
            client.chat.completions.create(messages=counting, **ask, **extra)
    plain = {"repetition_penalty": 1.0}  # so greedy takes the likeliest token of the model's distribution
    scored = client.chat.completions.create(messages=counting, logprobs=True, top_logprobs=2, extra_body=plain,
                                            **ask).choices[0]
    tokens = scored.logprobs.content
    assert "".join(t.token for t in tokens) == scored.message.content  # one entry per generated token
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in tokens)
    streamed = list(client.chat.completions.create(messages=counting, logprobs=True, stream=True, extra_body=plain,
                                                   **ask))
    assert [t.token for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.content] == \
        [t.token for t in tokens]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]
    with pytest.raises(openai.UnprocessableEntityError, match="only text content parts"):
        client.chat.completions.create(messages=image, **ask)
    assert app.health()["ready"]


def test_logit_bias_forces_or_bans_a_token(app, bundled_tokenizer):
    client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
    ask = dict(model="any", messages=[{"role": "user", "content": CAPITAL}], temperature=0.0, max_tokens=6,
               logprobs=True)
    (paris,) = bundled_tokenizer(" Paris", add_special_tokens=False).input_ids
    forced = client.chat.completions.create(logit_bias={str(paris): 100}, **ask).choices[0]
    assert [t.token for t in forced.logprobs.content] == [" Paris"] * 6 and forced.message.content == " Paris" * 6
    first = client.chat.completions.create(**ask).choices[0].logprobs.content[0].token  # greedy: "The"
    (greedy,) = bundled_tokenizer(first, add_special_tokens=False).input_ids
    banned = client.chat.completions.create(logit_bias={str(greedy): -100}, **ask).choices[0]
    assert banned.logprobs.content[0].token != first
    with pytest.raises(openai.BadRequestError, match="outside this model's vocabulary") as refused:
        client.chat.completions.create(logit_bias={str(len(bundled_tokenizer)): 1}, **ask)
    assert refused.value.param == "logit_bias"


def test_frequency_penalty_cuts_repetition_and_min_p_1_is_greedy(app):
    client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
    ask = dict(model="any", messages=[{"role": "user", "content": "Write the word 'hello' twenty times."}],
               temperature=0.0, max_tokens=32, logprobs=True, extra_body={"repetition_penalty": 1.0})

    def repeats(penalty: float) -> int:
        tokens = [t.token for t in client.chat.completions.create(frequency_penalty=penalty, **ask)
                  .choices[0].logprobs.content]
        return len(tokens) - len(set(tokens))

    plain, penalized = repeats(0.0), repeats(2.0)
    assert penalized < plain and plain > 10, (penalized, plain)  # greedy alone says hello over and over
    greedy = client.chat.completions.create(model="any", messages=[{"role": "user", "content": CAPITAL}],
                                            temperature=0.0, max_tokens=24)
    only_likeliest = client.chat.completions.create(model="any", messages=[{"role": "user", "content": CAPITAL}],
                                                    temperature=1.0, seed=3, max_tokens=24, extra_body={"min_p": 1.0})
    assert only_likeliest.choices[0].message.content == greedy.choices[0].message.content


def test_an_unknown_field_is_a_400_naming_it_and_the_openapi_document_describes_the_request(app):
    client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: frobnicate") as refused:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": CAPITAL}], max_tokens=4,
                                       extra_body={"frobnicate": True})
    assert refused.value.param == "frobnicate" and refused.value.type == "invalid_request_error"
    informational = client.chat.completions.create(model="any", messages=[{"role": "user", "content": CAPITAL}],
                                                   max_tokens=4, user="alice", metadata={"k": "v"}, store=False,
                                                   service_tier="auto")
    assert informational.choices[0].message.content
    schema = httpx.get(app.url + "/openapi.json", timeout=10).json()["paths"]["/v1/chat/completions"]["post"][
        "requestBody"]["content"]["application/json"]["schema"]
    assert {"messages", "logit_bias", "frequency_penalty", "min_p", "stream_options"} <= set(schema["properties"])


def test_logprobs_bytes_are_each_tokens_own(app):
    """An emoji is several byte-level tokens, each decoding to U+FFFD alone: their ``bytes``
    add up to the reply's UTF-8 (up to a character the token limit cut short)."""
    client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Write the emoji for "
                                                                   "a rocket."}], temperature=0.0, max_tokens=24,
                                           logprobs=True).choices[0]
    tokens, text = reply.logprobs.content, reply.message.content.encode("utf-8")
    joined = b"".join(bytes(t.bytes) for t in tokens)
    assert joined[:len(text)] == text and len(joined) - len(text) < 4
    split = [t for t in tokens if "\ufffd" in t.token]
    assert split and all(b"\xef\xbf\xbd" not in bytes(t.bytes) for t in split)  # the bytes, not U+FFFD's


def test_a_guessed_session_id_gets_nothing_of_another_clients_conversation(app):
    """Without --auth a client's scope is its address: 127.0.0.2 is another client of this
    loopback server. It sends Alice's exact words and her session id, and learns nothing."""
    def sdk(address: str) -> openai.OpenAI:
        transport = httpx.HTTPTransport(local_address=address)
        return openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0,
                             http_client=httpx.Client(transport=transport, timeout=120))

    alice, mallory = sdk("127.0.0.1"), sdk("127.0.0.2")
    ask = dict(model="any", temperature=0.0, max_tokens=16)
    said = [{"role": "user", "content": "My locker code is 4711 and my dog is called Rex. Say hello."}]
    first = alice.chat.completions.create(messages=said, extra_body={"session_id": "alice-1"}, **ask)
    guess = mallory.chat.completions.create(messages=said, extra_body={"session_id": "alice-1"}, **ask)
    assert guess.usage.prompt_tokens_details.cached_tokens == 0
    replay = said + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Thanks!"}]
    second = alice.chat.completions.create(messages=replay, **ask)  # the SDK's way: history again, no session id
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def scrape(app) -> dict[str, float]:
    """/metrics as {'name{label="value"}': value}, parsed by prometheus_client's own parser."""
    response = httpx.get(app.url + "/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def test_metrics_count_requests_tokens_and_cached_prompt_tokens(app):
    before = scrape(app)
    question = {"role": "user", "content": CAPITAL}
    first = httpx.post(app.url + "/v1/chat/completions", timeout=120, json={
        "messages": [question], "temperature": 0, "max_tokens": 32}).json()
    answer = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    second = httpx.post(app.url + "/v1/chat/completions", timeout=120, json={  # the history again, no session id
        "messages": [question, answer, {"role": "user", "content": "And of Germany?"}],
        "temperature": 0, "max_tokens": 32}).json()
    after = scrape(app)

    def moved(name):
        return after[name] - before.get(name, 0.0)

    finished = moved('cpu_chat_requests_total{outcome="stop"}') + moved('cpu_chat_requests_total{outcome="length"}')
    assert finished == 2
    assert moved('cpu_chat_requests_total{outcome="error"}') == 0
    usage = [first["usage"], second["usage"]]
    assert moved("cpu_chat_generated_tokens_total") == sum(u["completion_tokens"] for u in usage)
    assert moved("cpu_chat_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0, "the second turn should reuse the first turn's KV cache (routed back, matched on ids)"
    assert moved("cpu_chat_cached_prompt_tokens_total") == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    assert moved("cpu_chat_time_to_first_token_seconds_count") == 2
    assert moved("cpu_chat_time_per_output_token_seconds_count") == 2
    assert after["cpu_chat_workers"] == after["cpu_chat_ready_workers"] == 2
    assert after["cpu_chat_busy_workers"] == 0 and after["cpu_chat_queue_depth"] == 0
    assert after["cpu_chat_active_replies"] == 0
    assert after['cpu_chat_worker_restarts_total{worker="0"}'] == 0


def test_a_quoting_reply_is_drafted_and_counted_everywhere(app):
    """Prompt-lookup speculation is on by default: a reply that quotes its prompt reports its
    accepted drafts in the API's usage (as OpenAI reports a predicted output's), /health,
    /metrics and the page's stats line."""
    before, health_before = scrape(app), app.health()
    ask = f"Here is a text:\n\n{QUOTED}\n\nRepeat the text above exactly, word for word."
    reply = httpx.post(app.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": ask}], "temperature": 0, "max_tokens": 64}).json()
    details = reply["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] >= 0
    drafted = details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
    after, health = scrape(app), app.health()
    assert after["cpu_chat_accepted_tokens_total"] - before.get("cpu_chat_accepted_tokens_total", 0) == \
        details["accepted_prediction_tokens"]
    assert after["cpu_chat_drafted_tokens_total"] - before.get("cpu_chat_drafted_tokens_total", 0) == drafted
    counted = sum(w["accepted_tokens"] for w in health["workers"]) - \
        sum(w["accepted_tokens"] for w in health_before["workers"])
    assert counted == details["accepted_prediction_tokens"]
    page = Client(app.url + "/", verbose=False).submit(ask, *GREEDY_UI.values(), api_name="/chat")
    assert "drafted tokens accepted" in list(page)[-1]


def test_sigint_stops_the_app_and_every_worker(app):
    pids = app.worker_pids
    assert app.stop(signal.SIGINT) == 0
    assert wait_gone(pids) == []
