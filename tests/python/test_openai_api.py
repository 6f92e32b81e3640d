"""lantern serve driven by the official openai client: chat, streaming, completions,
stop strings."""

import requests

GREEDY = {"temperature": 0}


def test_health_and_models(server, client):
    assert requests.get(server.base_url + "/health", timeout=10).status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model] == ["lantern-test-model"]
    assert client.models.retrieve(server.model).id == server.model


def test_chat(server, client):
    r = client.chat.completions.create(
        model=server.model,
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_tokens=24,
        **GREEDY,
    )
    assert r.object == "chat.completion"
    assert r.model == server.model
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0
    assert 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # Content given as a list of text parts is the same conversation.
    parts = client.chat.completions.create(
        model=server.model,
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is the capital "},
                    {"type": "text", "text": "of France?"},
                ],
            },
        ],
        max_tokens=24,
        **GREEDY,
    )
    assert parts.choices[0].message.content == choice.message.content


def test_streaming_chat(server, client):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    whole = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=20, **GREEDY
    )
    stream = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in content_chunks]
    assert reasons[-1] == whole.choices[0].finish_reason
    assert all(r is None for r in reasons[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    # Without include_usage no chunk carries usage.
    plain = list(
        client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=5, stream=True, **GREEDY
        )
    )
    assert all(c.usage is None for c in plain)
    assert plain[-1].choices[0].finish_reason is not None


def _tokenize(server, text):
    r = requests.post(
        server.base_url + "/tokenize",
        json={"model": server.model, "prompt": text},
        headers=server.headers(),
        timeout=30,
    )
    r.raise_for_status()
    return r.json()["tokens"]


def test_completions_text_and_token_ids(server, client):
    prompt = "The three primary colors are"
    by_text = client.completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=12,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    assert by_text.object == "text_completion"
    assert by_text.choices[0].finish_reason == "length"
    assert by_text.usage.completion_tokens == 12
    ids = _tokenize(server, prompt)
    assert by_text.usage.prompt_tokens == len(ids)
    by_ids = client.completions.create(
        model=server.model,
        prompt=ids,
        max_tokens=12,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    # Streamed, the pieces add up to the same text.
    stream = client.completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=12,
        stream=True,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == by_text.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    # Several prompts: one choice each, in order.
    many = client.completions.create(
        model=server.model, prompt=[prompt, "Hello, my name is"], max_tokens=4, **GREEDY
    )
    assert [c.index for c in many.choices] == [0, 1]
    assert by_text.choices[0].text.startswith(many.choices[0].text)


def test_seeded_sampling_is_reproducible(server, client):
    kwargs = dict(
        model=server.model,
        prompt="My favourite animal is",
        max_tokens=12,
        temperature=1.0,
        seed=1234,
        n=2,
    )
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len(a.choices) == 2


def test_stop_strings(server, client):
    prompt = "Count: 1, 2, 3, 4, 5,"
    full = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True}, **GREEDY
    ).choices[0].text
    assert len(full) > 8, full
    stop = full[5:7]
    cut = full.index(stop)
    r = client.completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=24,
        stop=[stop, "zzz-never"],
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    assert r.choices[0].text == full[:cut]
    assert r.choices[0].finish_reason == "stop"
    # Streamed: the stop string never reaches the client either.
    pieces = list(
        client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=24,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
    )
    assert "".join(p.choices[0].text for p in pieces) == full[:cut]
    assert pieces[-1].choices[0].finish_reason == "stop"
    # Chat with a stop string.
    messages = [{"role": "user", "content": "List three fruits, one per line."}]
    chat_full = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=30, **GREEDY
    ).choices[0].message.content
    if "\n" in chat_full.strip():
        chat = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=30, stop="\n", **GREEDY
        )
        assert chat.choices[0].message.content == chat_full[: chat_full.index("\n")]
        assert chat.choices[0].finish_reason == "stop"


def test_max_tokens_and_usage_of_many_samples(server, client):
    r = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_completion_tokens=5,
        n=3,
        seed=7,
        temperature=0.8,
    )
    assert len(r.choices) == 3
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens <= 15
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
