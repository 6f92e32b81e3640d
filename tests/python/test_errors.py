"""Bad input gets a 4xx naming the problem, as the openai client's exceptions; the
server keeps serving."""

import openai
import pytest
import requests

USER = [{"role": "user", "content": "Hi"}]


def _message(exc_info) -> str:
    body = exc_info.value.body
    assert isinstance(body, dict), body
    # The openai client hands over the `error` object of the body.
    error = body.get("error", body)
    assert {"message", "type", "param", "code"} <= set(error), error
    return error["message"]


def test_unknown_model_is_not_found(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-imaginary", messages=USER, max_tokens=2)
    assert "gpt-imaginary" in _message(e)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-imaginary", prompt="Hi", max_tokens=2)


def test_bad_api_key(server):
    bad = server.client(api_key="not-the-key")
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=server.model, messages=USER, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = requests.post(server.base_url + "/v1/completions", json={"prompt": "Hi"}, timeout=10)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    # /health and /metrics stay open.
    assert requests.get(server.base_url + "/health", timeout=10).status_code == 200
    assert requests.get(server.base_url + "/metrics", timeout=10).status_code == 200


CHAT_CASES = [
    ("missing messages", {}, "messages"),
    ("empty messages", {"messages": []}, "messages"),
    ("unknown role", {"messages": [{"role": "robot", "content": "Hi"}]}, "robot"),
    ("max_tokens 0", {"messages": USER, "max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"messages": USER, "max_tokens": -1}, "max_tokens"),
    ("max_tokens past context", {"messages": USER, "max_tokens": 10**7}, "max_tokens"),
    ("temperature < 0", {"messages": USER, "temperature": -1}, "temperature"),
    ("top_p 0", {"messages": USER, "top_p": 0}, "top_p"),
    ("top_p > 1", {"messages": USER, "top_p": 1.5}, "top_p"),
    ("n 0", {"messages": USER, "n": 0}, "n must"),
    ("stop number", {"messages": USER, "stop": 3}, "stop"),
    ("stop list of numbers", {"messages": USER, "stop": [1, 2]}, "stop"),
    ("top_logprobs > 20", {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("presence_penalty > 2", {"messages": USER, "presence_penalty": 2.5}, "presence_penalty"),
    ("frequency_penalty < -2", {"messages": USER, "frequency_penalty": -3}, "frequency_penalty"),
    ("repetition_penalty 0", {"messages": USER, "repetition_penalty": 0}, "repetition_penalty"),
]


@pytest.mark.parametrize("name,fields,needle", CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_chat_bad_input(server, client, name, fields, needle):
    body = {"model": server.model, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        # extra_body sends the fields exactly as given, past the client's own typing.
        client.chat.completions.create(
            model=server.model, messages=body.pop("messages", openai.NOT_GIVEN), extra_body=body
        )
    assert needle in _message(e)


def test_prompt_longer_than_context(server, client):
    long_ids = [42] * (server.context_length + 1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=long_ids, max_tokens=1)
    assert "context" in _message(e)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "word " * (server.context_length + 10)}],
            max_tokens=1,
        )
    assert "context" in _message(e)


# Found by fuzzing: each names the field at fault (it was another field, or a 200).
NAMED_CASES = [
    ("chat", {"messages": USER, "chat_template": "{{ raise_exception('boom') }}"}, "chat_template", "request's chat_template failed"),
    ("chat", {"messages": USER, "chat_template": ""}, "chat_template", "empty prompt"),
    ("chat", {"messages": [{"role": "user", "content": ""}], "continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message", "nothing to continue"),
    ("completions", {"prompt": "Hi", "stop_token_ids": [10**8]}, "stop_token_ids", "outside the vocabulary"),
    ("completions", {"prompt": "Hi", "guided_regex": "\\"}, "guided_regex", "not a valid regular expression"),
    ("responses", {"input": "Hi", "store": "x"}, "store", "boolean"),
    ("responses", {"input": "Hi", "text": "x"}, "text", "object"),
    ("responses", {"input": "Hi", "metadata": "x"}, "metadata", "object of strings"),
    ("responses", {"input": "Hi", "truncation": "x"}, "truncation", "auto"),
    ("responses", {"input": "Hi", "min_tokens": 8, "max_output_tokens": 4}, "min_tokens", "max_output_tokens (4)"),
    ("responses", {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input", "call_id `nope`"),
]


@pytest.mark.parametrize("endpoint,fields,param,needle", NAMED_CASES)
def test_bad_fields_name_themselves(server, endpoint, fields, param, needle):
    path = {"chat": "chat/completions"}.get(endpoint, endpoint)
    body = fields if endpoint == "responses" else {"max_tokens": 2, **fields}
    r = requests.post(f"{server.base_url}/v1/{path}", json=body, headers=server.headers(), timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_odd_paths_and_deep_bodies_get_json_errors(server):
    for path in ["/v1/responses/%ff%fe", "/v1/models/%ff", "/v1/captures/%ff"]:
        r = requests.get(server.base_url + path, headers=server.headers(), timeout=30)
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", (path, r.text)
    r = requests.get(server.base_url + "/v1/responses/x/input_items?limit=x", headers=server.headers(), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    deep = "[" * 200 + "]" * 200
    r = requests.post(server.base_url + "/v1/completions", data='{"prompt": "x", "x": ' + deep + "}",
                      headers={**server.headers(), "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "128 levels" in r.json()["error"]["message"]


def test_completion_bad_input(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="Hi", max_tokens=0)
    assert "max_tokens" in _message(e)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="Hi", n=0)
    assert "n must" in _message(e)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="Hi", logprobs=21)
    assert "logprobs" in _message(e)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=[10**9], max_tokens=1)
    assert "vocabulary" in _message(e)


def test_a_token_limit_past_the_context_names_the_field_that_set_it(server, client):
    """The context check names the field the client sent: `max_tokens`,
    `max_completion_tokens` or the Responses API's `max_output_tokens`."""
    ask = [{"role": "user", "content": "Hi"}]
    for field in ["max_tokens", "max_completion_tokens"]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.model, messages=ask, **{field: 10**9})
        assert e.value.body["param"] == field, e.value.body
        assert _message(e).startswith(f"{field} is {10**9}"), _message(e)
    if hasattr(client, "responses"):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=server.model, input="Hi", max_output_tokens=10**9)
        assert e.value.body["param"] == "max_output_tokens", e.value.body


def test_invalid_json_and_oversized_body(server):
    url = server.base_url + "/v1/chat/completions"
    headers = {**server.headers(), "Content-Type": "application/json"}
    r = requests.post(url, data=b'{"messages": [', headers=headers, timeout=30)
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]
    big = b'{"prompt": "' + b"a" * (17 << 20) + b'"}'
    r = requests.post(server.base_url + "/v1/completions", data=big, headers=headers, timeout=60)
    assert r.status_code == 413
    assert "too large" in r.json()["error"]["message"]


def test_a_lone_surrogate_from_pythons_json_reads_as_a_replacement_character(server, client):
    # Text cut inside an emoji: json.dumps writes the lone half as an escape.
    cut = "Hello \U0001F600".encode("utf-16-le")[:-2].decode("utf-16-le", "surrogatepass")
    r = requests.post(server.base_url + "/v1/completions", json={"prompt": cut, "max_tokens": 1, "echo": True},
                      headers=server.headers(), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("Hello \ufffd")


def test_still_serving_after_errors(server, client):
    r = client.chat.completions.create(model=server.model, messages=USER, max_tokens=3)
    assert r.choices[0].message.content is not None
    server.wait_idle()
