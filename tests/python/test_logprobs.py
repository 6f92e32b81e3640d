"""Logprobs and penalties through the official openai client."""

import math

import openai
import pytest
import requests

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


def test_completion_logprobs_up_to_twenty(server, client):
    # vLLM's limit, not OpenAI's 5. Named by id, the 20 alternatives are 20 keys (by
    # text, tokens that decode alike would share one), in falling order, the chosen
    # greedy token first.
    r = client.completions.create(
        model=server.model,
        prompt="The sky is",
        max_tokens=3,
        logprobs=20,
        extra_body={"return_tokens_as_token_ids": True},
        **GREEDY,
    )
    lp = r.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 20
        values = list(top.values())
        assert values == sorted(values, reverse=True)
        assert next(iter(top)) == token and top[token] == logprob


def test_completion_top_logprobs_always_hold_the_chosen_token(server, client):
    # OpenAI's legacy logprobs: the k most likely tokens and the chosen one (k + 1 at
    # most); with k = 0, the chosen token alone. Echoed prompt tokens, often not the most
    # likely, show it best.
    for k in (0, 1):
        r = client.completions.create(
            model=server.model, prompt="Purple elephants dance quietly on", max_tokens=3,
            logprobs=k, echo=True, temperature=0,
            extra_body={"return_tokens_as_token_ids": True},
        )
        lp = r.choices[0].logprobs
        extra = 0
        for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert top[token] == logprob
            if k == 0:
                assert top == {token: logprob}
            else:
                assert len(top) in (1, 2)
                extra += len(top) == 2
                assert max(top.values()) == next(iter(top.values())) >= logprob
        if k == 1:
            assert extra > 0, "every echoed token was the most likely"


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


ECHO_PROMPT = "The capital of France is"


def _post(server, path, body):
    r = requests.post(server.base_url + path, json=body, headers=server.headers(), timeout=60)
    r.raise_for_status()
    return r.json()


def _pieces(server, text):
    """The prompt's token ids and each token decoded alone."""
    ids = _post(server, "/tokenize", {"model": server.model, "prompt": text})["tokens"]
    return ids, [_post(server, "/detokenize", {"tokens": [t]})["prompt"] for t in ids]


def _check_echoed(choice, lp, pieces, k):
    """The prompt part of an echoed completion's logprobs."""
    n_prompt = len(pieces)
    assert lp.tokens[:n_prompt] == pieces
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for token, logprob, top in zip(pieces[1:], lp.token_logprobs[1:n_prompt], lp.top_logprobs[1:n_prompt]):
        assert math.isfinite(logprob) and logprob <= 0
        # The k most likely and the prompt's own token (k + 1 when it is not among them).
        assert 1 <= len(top) <= k + 1 and top[token] == logprob
        assert all(math.isfinite(v) and v <= 0 for v in top.values())
        # The alternatives are the most likely tokens: none less likely than the prompt's.
        assert max(top.values()) >= logprob - 1e-6
    # Offsets point into the returned text, which starts with the prompt.
    assert choice.text.startswith(ECHO_PROMPT)
    for token, offset in zip(lp.tokens[:n_prompt], lp.text_offset[:n_prompt]):
        assert choice.text[offset : offset + len(token)] == token
    if len(lp.tokens) > n_prompt:
        assert lp.text_offset[n_prompt] == len(ECHO_PROMPT)


def test_completion_echo_logprobs(server, client):
    ids, pieces = _pieces(server, ECHO_PROMPT)
    assert "".join(pieces) == ECHO_PROMPT
    r = client.completions.create(
        model=server.model, prompt=ECHO_PROMPT, max_tokens=4, echo=True, logprobs=2, **GREEDY
    )
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert r.usage.prompt_tokens == len(ids)
    n = len(ids) + r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    _check_echoed(choice, lp, pieces, 2)
    # The generated part is what the same request without echo gets.
    plain = client.completions.create(
        model=server.model, prompt=ECHO_PROMPT, max_tokens=4, logprobs=2, **GREEDY
    )
    assert choice.text == ECHO_PROMPT + plain.choices[0].text
    assert lp.tokens[len(ids) :] == plain.choices[0].logprobs.tokens
    for a, b in zip(lp.token_logprobs[len(ids) :], plain.choices[0].logprobs.token_logprobs):
        assert abs(a - b) < 1e-3
    # Offsets of generated tokens go on from the echoed prompt's text.
    offsets = lp.text_offset[len(ids) :]
    for i in range(1, len(offsets)):
        assert offsets[i] == offsets[i - 1] + len(lp.tokens[len(ids) + i - 1])

    # Streamed: the prompt and its logprobs come with the first chunk, then the rest.
    stream = client.completions.create(
        model=server.model,
        prompt=ECHO_PROMPT,
        max_tokens=4,
        echo=True,
        logprobs=2,
        stream=True,
        **GREEDY,
    )
    chunks = [c for c in stream if c.choices]
    first = chunks[0].choices[0]
    assert first.text.startswith(ECHO_PROMPT)
    assert first.logprobs.tokens[: len(ids)] == pieces
    text, tokens, logprobs, offsets = "", [], [], []
    for c in chunks:
        text += c.choices[0].text
        if c.choices[0].logprobs:
            tokens.extend(c.choices[0].logprobs.tokens)
            logprobs.extend(c.choices[0].logprobs.token_logprobs)
            offsets.extend(c.choices[0].logprobs.text_offset)
    assert text == choice.text
    assert tokens == lp.tokens
    assert offsets == lp.text_offset
    assert logprobs[0] is None
    for a, b in zip(logprobs[1:], lp.token_logprobs[1:]):
        assert abs(a - b) < 1e-4


def test_prompt_logprobs_match_generated_logprobs(server, client):
    """A prompt token's logprob is what the model gave it when it generated it."""
    ids, pieces = _pieces(server, ECHO_PROMPT)
    first = client.completions.create(
        model=server.model,
        prompt=ECHO_PROMPT,
        max_tokens=6,
        logprobs=0,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    generated = first.choices[0].logprobs
    extended = ECHO_PROMPT + first.choices[0].text
    ext_ids, ext_pieces = _pieces(server, extended)
    # The text tokenizes back to the prompt's tokens then the generated ones.
    assert ext_pieces == pieces + generated.tokens, (ext_pieces, pieces, generated.tokens)
    second = client.completions.create(
        model=server.model, prompt=ext_ids, max_tokens=1, echo=True, logprobs=1, **GREEDY
    )
    lp = second.choices[0].logprobs
    assert lp.tokens[: len(ext_ids)] == ext_pieces
    echoed = lp.token_logprobs[len(ids) : len(ext_ids)]
    assert len(echoed) == len(generated.token_logprobs)
    for a, b in zip(echoed, generated.token_logprobs):
        assert abs(a - b) < 1e-3, (echoed, generated.token_logprobs)
    # Greedy: each generated token was the most likely one after its prefix.
    part = slice(len(ids), len(ext_ids))
    for token, top in zip(lp.tokens[part], lp.top_logprobs[part]):
        assert list(top) == [token]


def test_vllm_prompt_logprobs(server, client):
    ids, pieces = _pieces(server, ECHO_PROMPT)
    r = client.completions.create(
        model=server.model,
        prompt=ECHO_PROMPT,
        max_tokens=2,
        echo=True,
        logprobs=1,
        extra_body={"prompt_logprobs": 3},
        **GREEDY,
    )
    choice = r.choices[0]
    plp = choice.model_extra["prompt_logprobs"]
    assert len(plp) == len(ids)
    assert plp[0] is None
    echoed = choice.logprobs.token_logprobs
    for i in range(1, len(ids)):
        entries = plp[i]
        own = entries[str(ids[i])]
        assert own["decoded_token"] == pieces[i]
        assert abs(own["logprob"] - echoed[i]) < 1e-6
        assert own["rank"] >= 1
        # The token itself and the 3 most likely ones (it may be one of them).
        assert 3 <= len(entries) <= 4
        ranks = sorted(e["rank"] for t, e in entries.items() if t != str(ids[i]))
        assert ranks in ([1, 2, 3], [1, 2], [2, 3], [1, 3])
        best = max(entries.values(), key=lambda e: e["logprob"])
        assert best["rank"] == 1
    # Echo's alternatives are the first `logprobs` of them (then the token itself).
    for i in range(1, len(ids)):
        token, logprob = next(iter(choice.logprobs.top_logprobs[i].items()))
        best = max(plp[i].values(), key=lambda e: e["logprob"])
        assert token == best["decoded_token"]
        assert abs(logprob - best["logprob"]) < 1e-6
    # Chat: one list beside the choices.
    chat = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
        **GREEDY,
    )
    plp = chat.model_extra["prompt_logprobs"]
    assert len(plp) == chat.usage.prompt_tokens
    assert plp[0] is None
    for entries in plp[1:]:
        (own,) = entries.values()
        assert own["logprob"] <= 0 and own["rank"] >= 1
    # Not with streaming (as vLLM).
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=server.model,
            prompt=ECHO_PROMPT,
            max_tokens=2,
            stream=True,
            extra_body={"prompt_logprobs": 1},
        )
    assert "prompt_logprobs" in str(e.value)
    server.wait_idle()
