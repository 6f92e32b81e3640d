"""vLLM's beam search: `use_beam_search` with `n` beams through the official `openai`
client on both endpoints (whole and streamed), and `LLM.beam_search` in Python. The
choices are the model's sequences ranked by vLLM's score, one beam is greedy decoding,
the Python API gives the server's beams, and what beam search cannot honour is a 400
naming its field."""

import math

import numpy as np
import openai
import pytest

import lantern
from conftest import start_server, stop_server

PROMPT = "The three most important inventions in history are"
EOS = "<|im_end|>"


def beams(client, server, **fields):
    extra = {"use_beam_search": True, **fields.pop("extra_body", {})}
    return client.completions.create(model=server.model, prompt=PROMPT, extra_body=extra, **fields)


def score(choice, prompt_tokens, penalty=1.0):
    """vLLM's: the sum of the logprobs over the length with the prompt, less a final EOS."""
    lps = choice.logprobs.token_logprobs
    length = prompt_tokens + len(lps) - (choice.logprobs.tokens[-1] == EOS)
    return sum(lps) / length ** penalty


@pytest.mark.parametrize("penalty", [1.0, 0.0, 2.0])
def test_choices_are_ranked_by_vllms_score(server, client, penalty):
    r = beams(client, server, n=4, max_tokens=10, logprobs=2, extra_body={"length_penalty": penalty})
    assert len(r.choices) == 4
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 4, texts
    scores = [score(c, r.usage.prompt_tokens, penalty) for c in r.choices]
    assert scores == sorted(scores, reverse=True), scores
    for c in r.choices:
        assert c.finish_reason in ("stop", "length")
        # Each token is the beam's own: one of its step's alternatives.
        for token, lp, top in zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs):
            assert top[token] == lp
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)


def test_one_beam_is_greedy_and_beams_score_at_least_as_well(server, client):
    greedy = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    one = beams(client, server, n=1, max_tokens=8, logprobs=0)
    assert one.choices[0].text == greedy.choices[0].text
    four = beams(client, server, n=4, max_tokens=8, logprobs=0, extra_body={"length_penalty": 0.0})
    best = sum(four.choices[0].logprobs.token_logprobs)
    if four.choices[0].finish_reason == greedy.choices[0].finish_reason == "length":
        assert best >= sum(greedy.choices[0].logprobs.token_logprobs) - 1e-4


def test_chat_streams_the_same_beams(server, client):
    messages = [{"role": "user", "content": "Name a colour."}]
    args = dict(model=server.model, messages=messages, max_tokens=12, n=3, extra_body={"use_beam_search": True})
    whole = client.chat.completions.create(**args)
    texts = [""] * 3
    finish = [None] * 3
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_end_beams(server, client):
    r = beams(client, server, n=3, max_tokens=16, stop=["."], extra_body={"include_stop_str_in_output": True})
    for c in r.choices:
        if c.finish_reason == "stop" and c.stop_reason == ".":
            assert c.text.endswith(".") and c.text.count(".") == 1, c.text


def test_what_beam_search_cannot_honour_is_400(server, client):
    for fields, param in [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"bad_words": ["the"]}, "bad_words"),
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        # Past an f32: no finite score.
        ({"length_penalty": 1e39}, "length_penalty"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            beams(client, server, n=2, max_tokens=4, extra_body=fields)
        assert e.value.body["param"] == param, fields
    with pytest.raises(openai.BadRequestError) as e:
        beams(client, server, n=2, max_tokens=0, extra_body={"echo": True})
    assert e.value.body["param"] == "max_tokens"


@pytest.fixture(scope="module")
def capture_server():
    srv = start_server("--enable-attention-capture")
    yield srv
    stop_server(srv)


def test_early_stopping_ends_an_unbounded_chat_search(server, client):
    messages = [{"role": "user", "content": "Say hi."}]
    # Without max_tokens a chat may run to the context's end: `early_stopping` ends the
    # search once n beams have finished (true), or none outranks them as it stands (false).
    for early in (True, False):
        r = client.chat.completions.create(
            model=server.model, messages=messages, n=2, timeout=120,
            extra_body={"use_beam_search": True, "early_stopping": early},
        )
        assert len(r.choices) == 2
        assert any(c.finish_reason == "stop" for c in r.choices), r.choices
    bounded = dict(model=server.model, messages=messages, n=2, max_tokens=10)
    exact = client.chat.completions.create(**bounded, extra_body={"use_beam_search": True})
    never = client.chat.completions.create(**bounded, extra_body={"use_beam_search": True, "early_stopping": "never"})
    assert [c.message.content for c in exact.choices] == [c.message.content for c in never.choices]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**bounded, extra_body={"use_beam_search": True, "early_stopping": "soon"})
    assert e.value.body["param"] == "early_stopping"


def test_forced_tool_calls_name_tool_choice(server, client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=2,
                tools=tools, tool_choice=choice, extra_body={"use_beam_search": True},
            )
        assert e.value.body["param"] == "tool_choice"


def test_a_full_waiting_queue_refuses_a_search_before_it_starts():
    """A search counts for its n beams when it is taken; once taken, its steps are
    never refused for the queue's length (which would throw its work away)."""
    srv = start_server("--max-waiting-requests", "2")
    try:
        client = srv.client(max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=srv.model, prompt="Hi there", max_tokens=5, n=4,
                                      extra_body={"use_beam_search": True})

        def search(i):
            try:
                r = client.completions.create(model=srv.model, prompt=f"Story {i}: Once", max_tokens=20, n=2,
                                              extra_body={"use_beam_search": True})
                return len(r.choices)
            except openai.RateLimitError:
                return 429

        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(6) as pool:
            outcomes = list(pool.map(search, range(6)))
        assert all(o in (2, 429) for o in outcomes), outcomes
        assert 2 in outcomes
    finally:
        stop_server(srv)


def test_capture_with_beam_search_names_the_way_to_capture_a_beam(capture_server):
    client = capture_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=capture_server.model, prompt=PROMPT, max_tokens=4, n=2,
            extra_body={"use_beam_search": True, "attn_capture": True},
        )
    assert e.value.body["param"] == "attn_capture"
    assert "max_tokens 0" in e.value.body["message"]


@pytest.fixture(scope="module")
def llm():
    engine = lantern.LLM(kv_cache_memory="256M")
    yield engine
    engine.close()


def test_python_beam_search_gives_the_servers_beams(server, client, llm):
    params = lantern.BeamSearchParams(beam_width=3, max_tokens=10)
    out = llm.beam_search([PROMPT, {"prompt": "def add(a, b):"}], params)
    assert len(out) == 2 and all(len(o.sequences) == 3 for o in out)
    served = beams(client, server, n=3, max_tokens=10, logprobs=0)
    prompt_ids = llm.encode(PROMPT)
    for seq, choice in zip(out[0].sequences, served.choices):
        assert seq.tokens[: len(prompt_ids)] == prompt_ids
        generated = seq.tokens[len(prompt_ids):]
        assert llm.decode(generated, skip_special_tokens=True) == choice.text
        assert math.isclose(seq.cum_logprob, sum(choice.logprobs.token_logprobs), rel_tol=1e-4, abs_tol=1e-4)
        assert seq.text == llm.decode(seq.tokens)
        assert seq.finish_reason == choice.finish_reason
        assert len(seq.logprobs) == len(generated)
        for token, lps in zip(generated, seq.logprobs):
            assert token in lps
    with pytest.raises(lantern.InvalidRequestError) as e:
        lantern.BeamSearchParams(beam_width=0, max_tokens=4)
    assert e.value.param == "beam_width"
    # One prompt at a time gives the same beams.
    one_by_one = llm.beam_search([PROMPT], params, concurrency_limit=1)
    assert [s.tokens for s in one_by_one[0].sequences] == [s.tokens for s in out[0].sequences]


def test_cli_beam_search_gives_the_servers_beams(server, client):
    import json
    import subprocess

    from conftest import _binary

    out = subprocess.run(
        [str(_binary()), "generate", "--json", "--beam-width", "3", "--max-tokens", "10",
         "--length-penalty", "0.5", "--prompt", PROMPT],
        capture_output=True, text=True, timeout=300, check=True,
    )
    line = json.loads(out.stdout)
    served = beams(client, server, n=3, max_tokens=10, logprobs=0, extra_body={"length_penalty": 0.5})
    assert [b["text"] for b in line["beams"]] == [c.text for c in served.choices]
    assert [b["finish_reason"] for b in line["beams"]] == [c.finish_reason for c in served.choices]
    for b, c in zip(line["beams"], served.choices):
        assert math.isclose(b["cumulative_logprob"], sum(c.logprobs.token_logprobs), rel_tol=1e-4, abs_tol=1e-4)
    assert line["text"] == line["beams"][0]["text"]
    refused = subprocess.run(
        [str(_binary()), "generate", "--beam-width", "2", "--capture", "/tmp/never.safetensors", "--prompt", "x"],
        capture_output=True, text=True, timeout=60,
    )
    assert refused.returncode != 0 and "--beam-width" in refused.stderr


def test_the_responses_api_refuses_beam_search(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.model, input="Hi", max_output_tokens=4,
                                extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "use_beam_search"


def test_metrics_count_a_running_search(server, client):
    """Between two of its steps a search has no request in the engine: its own gauge
    says it runs."""
    import threading
    import time

    done = threading.Event()

    def search():
        try:
            beams(client, server, n=2, max_tokens=150, extra_body={"ignore_eos": True})
        finally:
            done.set()

    threading.Thread(target=search, daemon=True).start()
    seen = 0.0
    deadline = time.monotonic() + 60
    while not done.is_set() and time.monotonic() < deadline and seen < 1:
        seen = server.metrics().get("lantern:beam_searches_running", 0.0)
        time.sleep(0.05)
    assert seen == 1.0
    done.wait(120)
    time.sleep(0.2)
    assert server.metrics()["lantern:beam_searches_running"] == 0.0


def test_python_beam_search_captures_each_sequence(llm):
    params = lantern.BeamSearchParams(beam_width=2, max_tokens=6)
    (out,) = llm.beam_search("The capital of France is", params, capture={"layers": [0, -1]})
    for seq in out.sequences:
        maps = seq.attention.maps
        n = len(seq.tokens)
        assert maps[0].shape[0] == n and maps[0].shape[2] == n
        # Rows are probabilities over the keys before them.
        np.testing.assert_allclose(maps[0].sum(axis=-1), 1.0, rtol=1e-4)
        assert np.all(np.triu(maps[0][:, 0, :], k=1) == 0)
        # The same map as capturing the sequence sent as a prompt.
        (alone,) = llm.generate([{"prompt_token_ids": seq.tokens}], lantern.SamplingParams(max_tokens=0),
                                capture={"layers": [0]})
        np.testing.assert_array_equal(alone.attention.maps[0], maps[0])
