"""vLLM's request fields through the official `openai` client (`extra_body`):
`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs` and `echo` on
chat, `min_tokens` and `logit_bias` on both endpoints; unknown fields are named in one
warning line and the request still succeeds; `GET /version`."""

import subprocess
import time

import openai
import pytest
import requests

from conftest import _binary, detokenize, one_token, start_server, stop_server, tokenize

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PREFIX = "The capital of France is"


def chat(client, server, messages, **extra):
    fields = {k: extra.pop(k) for k in ("max_tokens", "stop", "stream", "n") if k in extra}
    fields.setdefault("max_tokens", 8)
    return client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, extra_body=extra, **fields
    )


def test_add_generation_prompt_false_leaves_out_the_assistant_header(server, client):
    with_header = chat(client, server, QUESTION, max_tokens=1)
    without = chat(client, server, QUESTION, max_tokens=1, add_generation_prompt=False)
    assert without.usage.prompt_tokens < with_header.usage.prompt_tokens
    # What was rendered, through /tokenize (which takes the same fields).
    opened = tokenize(server, messages=QUESTION)
    closed = tokenize(server, messages=QUESTION, add_generation_prompt=False)
    assert len(opened) == with_header.usage.prompt_tokens
    assert len(closed) == without.usage.prompt_tokens
    assert detokenize(server, opened).endswith("<|im_start|>assistant\n")
    assert detokenize(server, closed).endswith("<|im_end|>\n")


def test_continue_final_message_continues_the_assistant_prefix(server, client):
    messages = QUESTION + [{"role": "assistant", "content": PREFIX}]
    prompt = tokenize(server, messages=messages, continue_final_message=True, add_generation_prompt=False)
    # The prompt ends inside the assistant's turn, right after the prefix.
    assert detokenize(server, prompt).endswith(PREFIX)
    r = chat(client, server, messages, max_tokens=6, continue_final_message=True, add_generation_prompt=False)
    assert r.usage.prompt_tokens == len(prompt)
    # The same continuation as a completion of exactly that prompt.
    c = client.completions.create(model=server.model, prompt=prompt, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == c.choices[0].text
    # Without it, the prefix is a finished turn and a new one starts.
    closed = tokenize(server, messages=messages)
    assert len(closed) > len(prompt)


def test_continue_final_message_with_add_generation_prompt_is_400(server, client):
    messages = QUESTION + [{"role": "assistant", "content": PREFIX}]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, server, messages, continue_final_message=True, add_generation_prompt=True)
    assert e.value.body["param"] == "continue_final_message"


def test_chat_echo_prepends_the_final_assistant_message(server, client):
    messages = QUESTION + [{"role": "assistant", "content": PREFIX}]
    plain = chat(client, server, messages, max_tokens=6, continue_final_message=True)
    echoed = chat(client, server, messages, max_tokens=6, continue_final_message=True, echo=True)
    assert echoed.choices[0].message.content == PREFIX + plain.choices[0].message.content
    stream = chat(client, server, messages, max_tokens=6, continue_final_message=True, echo=True, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == echoed.choices[0].message.content
    # A user message last: nothing to echo.
    r = chat(client, server, QUESTION, max_tokens=4, echo=True)
    assert not r.choices[0].message.content.startswith(QUESTION[0]["content"])


def test_logit_bias_forces_and_bans_tokens(server, client):
    banana = one_token(server, " banana")
    r = client.completions.create(
        model=server.model, prompt="My favourite word is", max_tokens=3, temperature=0,
        logit_bias={str(banana): 100},
    )
    assert r.choices[0].text == detokenize(server, [banana] * 3)
    # -100 on the greedy first token: another one comes first.
    greedy = client.completions.create(model=server.model, prompt="1, 2, 3,", max_tokens=1, temperature=0)
    first = tokenize(server, prompt=greedy.choices[0].text, add_special_tokens=False)[0]
    banned = client.completions.create(
        model=server.model, prompt="1, 2, 3,", max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text != greedy.choices[0].text
    for bias, what in [({str(banana): 101}, "[-100, 100]"), ({"99999999": 1}, "vocabulary"), ({"x": 1}, "token ids")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=server.model, prompt="x", max_tokens=1, logit_bias=bias)
        assert e.value.body["param"] == "logit_bias"
        assert what in e.value.body["message"]


def test_min_tokens_holds_off_eos_and_stop_token_ids(server, client):
    eos = one_token(server, "<|im_end|>")
    # EOS forced by the bias: it ends the request at its first token...
    r = chat(client, server, QUESTION, max_tokens=20, logit_bias={str(eos): 100})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens <= 1
    # ...unless min_tokens holds it off until then.
    r = chat(client, server, QUESTION, max_tokens=20, logit_bias={str(eos): 100}, min_tokens=7)
    assert r.choices[0].finish_reason == "stop"
    assert 7 <= r.usage.completion_tokens <= 8
    # The same for a stop token id on completions.
    banana = one_token(server, " banana")
    c = client.completions.create(
        model=server.model, prompt="Fruit:", max_tokens=20, temperature=0,
        extra_body={"logit_bias": {str(banana): 100}, "stop_token_ids": [banana], "min_tokens": 5},
    )
    assert c.choices[0].finish_reason == "stop"
    assert c.choices[0].model_extra.get("stop_reason") == banana
    assert c.usage.completion_tokens == 6


def test_a_stop_token_ids_text_is_left_out_unless_asked_for(server, client):
    # As vLLM: the token that stops the sequence counts among its tokens, but its text
    # joins the output only with include_stop_str_in_output (as a stop string would).
    banana = one_token(server, " banana")
    for stream in (False, True):
        texts = {}
        for include in (False, True):
            kwargs = dict(
                model=server.model, prompt="Fruit:", max_tokens=20, temperature=0,
                extra_body={
                    "logit_bias": {str(banana): 100},
                    "stop_token_ids": [banana],
                    "min_tokens": 3,
                    "include_stop_str_in_output": include,
                },
            )
            if stream:
                chunks = list(client.completions.create(stream=True, **kwargs))
                texts[include] = "".join(c.choices[0].text for c in chunks if c.choices)
                assert chunks[-1].choices[0].finish_reason == "stop"
            else:
                c = client.completions.create(**kwargs)
                assert c.choices[0].finish_reason == "stop" and c.usage.completion_tokens == 4
                texts[include] = c.choices[0].text
        assert texts[True] == texts[False] + " banana", (stream, texts)


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, client):
    text = "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday"
    ids = tokenize(server, prompt=text)
    kept = ids[-5:]
    r = client.completions.create(
        model=server.model, prompt=text, max_tokens=3, temperature=0, echo=True,
        extra_body={"truncate_prompt_tokens": 5},
    )
    assert r.usage.prompt_tokens == 5
    # The echo is the prompt that ran, and so is the continuation: as sending its end.
    alone = client.completions.create(model=server.model, prompt=kept, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text == alone.choices[0].text
    assert r.choices[0].text.startswith(detokenize(server, kept))
    # Chat too; a prompt shorter than the cut runs whole.
    c = chat(client, server, QUESTION, max_tokens=1, truncate_prompt_tokens=4)
    assert c.usage.prompt_tokens == 4
    whole = chat(client, server, QUESTION, max_tokens=1, truncate_prompt_tokens=10_000)
    assert whole.usage.prompt_tokens == len(tokenize(server, messages=QUESTION, add_generation_prompt=True))
    r = client.responses.create(
        model=server.model, input="What is the capital of France?", max_output_tokens=1,
        extra_body={"truncate_prompt_tokens": 3},
    )
    assert r.usage.input_tokens == 3
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=text, max_tokens=1, extra_body={"truncate_prompt_tokens": 0})
    assert e.value.body["param"] == "truncate_prompt_tokens"


def test_min_tokens_holds_off_stop_strings(server, client):
    greedy = client.completions.create(model=server.model, prompt="The days of the week are", max_tokens=10, temperature=0)
    text = greedy.choices[0].text
    first_word = text.split()[0]
    stopped = client.completions.create(
        model=server.model, prompt="The days of the week are", max_tokens=10, temperature=0, stop=[first_word]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert first_word not in stopped.choices[0].text
    held = client.completions.create(
        model=server.model, prompt="The days of the week are", max_tokens=10, temperature=0,
        stop=[first_word], extra_body={"min_tokens": 10},
    )
    assert held.usage.completion_tokens == 10
    assert held.choices[0].text == text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="x", max_tokens=2, extra_body={"min_tokens": 3})
    assert e.value.body["param"] == "min_tokens"


def test_version(server):
    r = requests.get(server.base_url + "/version", timeout=10)
    assert r.status_code == 200
    version = r.json()["version"]
    out = subprocess.run([str(_binary()), "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["lantern", version]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server, client):
    kw = dict(model=server.model, max_tokens=6, temperature=0)
    plain = client.completions.create(prompt="The capital of France is", logprobs=2, echo=True, **kw)
    by_id = client.completions.create(
        prompt="The capital of France is",
        logprobs=2,
        echo=True,
        extra_body={"return_tokens_as_token_ids": True},
        **kw,
    )
    ids = tokenize(server, prompt="The capital of France is")
    a, b = plain.choices[0].logprobs, by_id.choices[0].logprobs
    # The same text, logprobs and offsets; the tokens (echoed prompt, generated, and the
    # alternatives) named by id, each naming the token whose text the plain response gave.
    assert by_id.choices[0].text == plain.choices[0].text
    assert b.token_logprobs == a.token_logprobs
    assert b.text_offset == a.text_offset
    named = [int(t.removeprefix("token_id:")) for t in b.tokens]
    assert all(t.startswith("token_id:") for t in b.tokens)
    assert named[: len(ids)] == ids
    assert [detokenize(server, [t]) for t in named] == a.tokens
    for top_a, top_b in zip(a.top_logprobs[1:], b.top_logprobs[1:]):
        assert sorted(top_b.values()) == sorted(top_a.values())
        texts = {detokenize(server, [int(k.removeprefix("token_id:"))]): v for k, v in top_b.items()}
        assert texts == top_a
    # Chat: `token` by id, `bytes` still the token's text.
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Say hello."}],
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
        **kw,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        text = detokenize(server, [int(entry.token.removeprefix("token_id:"))])
        assert bytes(entry.bytes) == text.encode()
        assert all(alt.token.startswith("token_id:") for alt in entry.top_logprobs)
    assert b"".join(bytes(e.bytes) for e in content).decode() == chat.choices[0].message.content


def test_continuous_usage_stats_puts_usage_in_every_chunk(server, client):
    for n in (1, 2):
        chunks = list(
            client.completions.create(
                model=server.model,
                prompt="Once upon a time",
                max_tokens=8,
                n=n,
                temperature=1,
                seed=3,
                stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
            )
        )
        prompt_tokens = len(tokenize(server, prompt="Once upon a time"))
        choice_chunks = [c for c in chunks if c.choices]
        assert choice_chunks and all(c.usage is not None for c in choice_chunks)
        seen = {}
        for c in choice_chunks:
            i = c.choices[0].index
            assert c.usage.prompt_tokens == prompt_tokens
            assert c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens
            # Each choice's count grows with its own tokens, never back.
            assert c.usage.completion_tokens >= seen.get(i, 0)
            seen[i] = c.usage.completion_tokens
        assert seen == {i: 8 for i in range(n)}
        # The final usage chunk is still the whole request's.
        assert chunks[-1].choices == []
        assert chunks[-1].usage.completion_tokens == 8 * n
    # Chat, the role chunk first (nothing generated yet).
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts[0] == 0 and counts == sorted(counts)
    assert counts[-1] == chunks[-1].usage.completion_tokens
    # Given options include the usage unless include_usage is false (vLLM's default).
    def streamed(options):
        return list(
            client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=3, stream=True, stream_options=options,
            )
        )

    assert all(c.usage is not None for c in streamed({"continuous_usage_stats": True}))
    assert all(c.usage is None for c in streamed({"include_usage": False, "continuous_usage_stats": True}))
    # Options for a stream that is not asked for are a mistake (vLLM's 400).
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
            stream_options={"include_usage": True},
        )
    assert e.value.body["param"] == "stream_options"


TEMPLATE = (
    "{% if house_style %}<|im_start|>system\n{{ house_style }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """A server with a chat template that reads a variable of its own, its log kept."""
    d = tmp_path_factory.mktemp("templated")
    (d / "template.jinja").write_text(TEMPLATE)
    log = open(d / "server.log", "w")
    srv = start_server("--chat-template", str(d / "template.jinja"), stderr=log)
    srv.log_path = d / "server.log"
    yield srv
    stop_server(srv)
    log.close()


def test_chat_template_kwargs_reach_the_template(templated):
    client = templated.client()
    kwargs = {"house_style": "Answer in French."}
    plain = chat(client, templated, QUESTION, max_tokens=1)
    styled = chat(client, templated, QUESTION, max_tokens=1, chat_template_kwargs=kwargs)
    assert styled.usage.prompt_tokens > plain.usage.prompt_tokens
    prompt = tokenize(templated, messages=QUESTION, chat_template_kwargs=kwargs)
    assert len(prompt) == styled.usage.prompt_tokens
    assert detokenize(templated, prompt).startswith("<|im_start|>system\nAnswer in French.<|im_end|>")
    # The template's own variables win over a kwarg of the same name.
    same = chat(client, templated, QUESTION, max_tokens=1, chat_template_kwargs={"messages": []})
    assert same.usage.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, templated, QUESTION, chat_template_kwargs={"house_style": "x" * 70000})
    assert e.value.body["param"] == "chat_template_kwargs"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, templated, QUESTION, chat_template_kwargs=["house_style"])
    assert e.value.body["param"] == "chat_template_kwargs"


def test_unknown_fields_are_named_in_one_warning(templated):
    client = templated.client()
    r = chat(client, templated, QUESTION, max_tokens=2, frobnicate_level=3, guided_vibes="calm")
    assert r.choices[0].finish_reason in ("length", "stop")
    deadline = time.monotonic() + 10
    while True:
        lines = [l for l in templated.log_path.read_text().splitlines() if "frobnicate_level" in l]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(lines) == 1, lines
    assert "WARN" in lines[0] and "guided_vibes" in lines[0] and "ignored" in lines[0]
    # Known fields are not named.
    assert "max_tokens" not in lines[0] and "temperature" not in lines[0]


def test_a_requests_chat_template_replaces_the_models(server, client):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    ids = tokenize(server, messages=QUESTION, chat_template=template)
    assert detokenize(server, ids) == "[user] What is the capital of France?\n"
    r = chat(client, server, QUESTION, max_tokens=1, chat_template=template)
    assert r.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, server, QUESTION, chat_template="{% for m in messages %")
    assert e.value.body["param"] == "chat_template"


def test_content_parts_and_roles_as_vllm_reads_them(server):
    # Text parts joined by newlines; the Responses API's part types and a refusal are text.
    parts = [{"type": "text", "text": "Hello"}, {"type": "input_text", "text": "World"}]
    messages = [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
        {"role": "ipython", "content": "{}"},
    ]
    text = detokenize(server, tokenize(server, messages=messages, add_generation_prompt=False))
    assert "user\nHello\nWorld<|im_end|>" in text
    assert "assistant\nI cannot.<|im_end|>" in text
    assert "<|im_start|>ipython\n{}" in text


def test_fields_lantern_cannot_honour_are_400_not_ignored(server, client):
    for fields, param in [
        ({"structural_tag": {"type": "structural_tag"}}, "structural_tag"),
        ({"logits_processors": ["my.module.Processor"]}, "logits_processors"),
        ({"priority": 5}, "priority"),
        ({"stop": ["", "x"]}, "stop"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=server.model, prompt="x", max_tokens=1, extra_body=fields)
        assert e.value.body["param"] == param, fields
    # Asking for nothing is fine.
    r = client.completions.create(
        model=server.model, prompt="x", max_tokens=1,
        extra_body={"use_beam_search": False, "logits_processors": [], "seed": -1, "priority": 0},
    )
    assert r.usage.completion_tokens == 1


def test_ping_load_and_invocations(server, client):
    for method in (requests.get, requests.post):
        r = method(server.base_url + "/ping", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "ok"
    r = requests.get(server.base_url + "/load", timeout=10)
    assert r.status_code == 200 and r.json()["server_load"] >= 0
    post = lambda body: requests.post(server.base_url + "/invocations", json=body, headers=server.headers(), timeout=60)
    c = post({"prompt": PREFIX, "max_tokens": 2, "temperature": 0}).json()
    assert c["object"] == "text_completion"
    assert c["choices"][0]["text"] == client.completions.create(
        model=server.model, prompt=PREFIX, max_tokens=2, temperature=0
    ).choices[0].text
    c = post({"messages": QUESTION, "max_tokens": 2}).json()
    assert c["object"] == "chat.completion"
    r = post({"input": "x"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_a_clients_request_id_names_the_response(server, client):
    r = client.completions.create(model=server.model, prompt="x", max_tokens=1,
                                  extra_body={"request_id": "job-7"})
    assert r.id == "cmpl-job-7"
    # The X-Request-Id header wins over the body's field, as in vLLM.
    c = client.chat.completions.create(
        model=server.model, messages=QUESTION, max_tokens=1, extra_body={"request_id": "job-7"},
        extra_headers={"X-Request-Id": "trace-42"},
    )
    assert c.id == "chatcmpl-trace-42"
    # And it comes back as the x-request-id header, which the client reads.
    assert c._request_id == "chatcmpl-trace-42"
    raw = client.responses.with_raw_response.create(model=server.model, input="x", max_output_tokens=1)
    assert raw.headers["x-request-id"] == raw.parse().id
    stream = client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=1, stream=True)
    assert stream.response.headers["x-request-id"].startswith("chatcmpl-")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="x", max_tokens=1,
                                  extra_body={"request_id": "has space"})
    assert e.value.body["param"] == "request_id"


def test_add_special_tokens_false_leaves_out_the_bos(tmp_path):
    # A tiny random-weight Gemma 3 (a Hugging Face directory) whose tokenizer adds BOS.
    srv = start_server("--model", "tests/fixtures/archs/gemma3_text/hf")
    try:
        client = srv.client()
        with_bos = tokenize(srv, prompt="Hello there")
        without = tokenize(srv, prompt="Hello there", add_special_tokens=False)
        assert with_bos[1:] == without and len(with_bos) == len(without) + 1
        for add, expected in [(None, with_bos), (True, with_bos), (False, without)]:
            extra = {} if add is None else {"add_special_tokens": add}
            r = client.completions.create(model=srv.model, prompt="Hello there", max_tokens=1, echo=True,
                                          logprobs=0, extra_body={**extra, "return_tokens_as_token_ids": True})
            echoed = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
            assert echoed[: len(expected)] == expected, add
            assert r.usage.prompt_tokens == len(expected)
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def recommending_model(tmp_path_factory):
    """The tiny Llama directory with a generation_config.json that recommends top_k 1
    (greedy whatever the temperature)."""
    import json
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    model = tmp_path_factory.mktemp("recommending") / "hf"
    shutil.copytree(root / "tests/fixtures/archs/llama/hf", model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.9, top_k=1)
    (model / "generation_config.json").write_text(json.dumps(config))
    return str(model)


def test_the_models_generation_config_gives_the_defaults(recommending_model):
    def choices(srv, **fields):
        r = srv.client().completions.create(model=srv.model, prompt="Hello there", max_tokens=8, n=3,
                                            extra_body={"ignore_eos": True, **fields})
        return [c.text for c in r.choices]

    srv = start_server("--model", recommending_model)
    try:
        defaulted = choices(srv)
        assert len(set(defaulted)) == 1  # top_k 1 from the model: one greedy text
        assert defaulted == choices(srv, temperature=0)
        assert len(set(choices(srv, top_k=0, seed=5))) > 1  # a request's own value wins
    finally:
        stop_server(srv)
    srv = start_server("--model", recommending_model, "--generation-config", "vllm")
    try:
        assert len(set(choices(srv, seed=5))) > 1
    finally:
        stop_server(srv)
