"""Logprobs and penalties through the official openai client."""

import math

GREEDY = {"temperature": 0}
MESSAGES = [{"role": "user", "content": "Name three colours."}]


def test_chat_logprobs(server, client):
    r = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert isinstance(entry.token, str)
        assert entry.logprob <= 0 and math.isfinite(entry.logprob)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3
        top = [t.logprob for t in entry.top_logprobs]
        assert top == sorted(top, reverse=True)
        assert all(t <= 0 for t in top)
        # Greedy: the chosen token is the most likely alternative.
        assert entry.top_logprobs[0].token == entry.token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6
    # Without logprobs there are none.
    plain = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=8, **GREEDY
    )
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content


def test_streaming_chat_logprobs(server, client):
    whole = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=2, **GREEDY
    )
    stream = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        **GREEDY,
    )
    streamed = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            streamed.extend(chunk.choices[0].logprobs.content)
    expected = whole.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in expected]
    assert [round(e.logprob, 4) for e in streamed] == [round(e.logprob, 4) for e in expected]


def test_completion_logprobs(server, client):
    r = client.completions.create(
        model=server.model, prompt="The sky is", max_tokens=6, logprobs=2, **GREEDY
    )
    choice = r.choices[0]
    lp = choice.logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(l <= 0 for l in lp.token_logprobs)
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2
        assert all(v <= 0 for v in top.values())
        best = max(top, key=top.get)
        assert best == token
        assert abs(top[best] - logprob) < 1e-6
    # Streaming carries the same tokens, offsets continuing across chunks.
    stream = client.completions.create(
        model=server.model, prompt="The sky is", max_tokens=6, logprobs=2, stream=True, **GREEDY
    )
    tokens, offsets = [], []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens.extend(chunk.choices[0].logprobs.tokens)
            offsets.extend(chunk.choices[0].logprobs.text_offset)
    assert tokens == lp.tokens
    assert offsets == lp.text_offset


def test_penalties_are_accepted_and_change_repetition(server, client):
    prompt = "one one one one one one one one"
    base = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=16, **GREEDY
    )
    for extra in (
        {"presence_penalty": 2.0, "frequency_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 1.5}},
    ):
        r = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=16, **GREEDY, **extra
        )
        assert r.choices[0].text is not None
        assert r.usage.completion_tokens > 0
    # A neutral penalty changes nothing.
    same = client.completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=16,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        extra_body={"repetition_penalty": 1.0},
        **GREEDY,
    )
    assert same.choices[0].text == base.choices[0].text
