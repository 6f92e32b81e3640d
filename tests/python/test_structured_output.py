"""Structured output with the openai client: outputs parse and validate against their
schemas (greedy and sampled), regex, choice and Lark grammars hold, and a bad schema is
a 400 naming its field. The grammar guarantees validity; the only allowed miss is a
request cut by max_tokens, so each test checks finish_reason and sizes max_tokens to
let the output close."""

import json
import re

import jsonschema
import openai
import pytest

MAX_TOKENS = 300
USER = "Describe a fictional person as JSON."

SHORT = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": SHORT}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25}}, "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}}, "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"address": {"type": "object", "properties": {"city": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"], "additionalProperties": False}}, "required": ["address"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "null"}]}}, "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["kind", "x"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}, "required": ["date"], "additionalProperties": False},
    {"$defs": {"item": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["id"], "additionalProperties": False}}, "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}}, "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, "maxItems": 2}}, "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}, "label": {"type": "string", "minLength": 1, "maxLength": 8}}, "required": ["level", "label"], "additionalProperties": False},
    {"type": "string", "maxLength": 16},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
]


def _response_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_chat_outputs_validate_against_their_schemas(server, client, sampled):
    assert len(SCHEMAS) >= 15
    for i, schema in enumerate(SCHEMAS):
        r = client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": USER}],
            response_format=_response_format(schema),
            max_tokens=MAX_TOKENS,
            temperature=0.9 if sampled else 0.0,
            seed=i,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_completions_json_schema_and_vllm_guided_json(server, client):
    for i, schema in enumerate(SCHEMAS[:4]):
        r = client.completions.create(
            model=server.model,
            prompt="A JSON record:",
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"guided_json": schema},
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].text
        jsonschema.validate(json.loads(r.choices[0].text), schema)
    schema = SCHEMAS[6]
    r = client.completions.create(
        model=server.model,
        prompt="A JSON record:",
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"response_format": _response_format(schema)},
    )
    jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_json_object_streamed(server, client):
    stream = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Give a JSON object with a name."}],
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        # Cut by max_tokens: what was written is the start of an object.
        assert finish == "length" and text.startswith("{"), (finish, text)


def test_regex_choice_and_grammar(server, client):
    for body, check in [
        ({"guided_regex": r"[A-Z][a-z]{2,6} [0-9]{2}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{2}", t)),
        ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        ({"guided_grammar": 'start: "The answer is " DIGIT "."\nDIGIT: /[0-9]/'}, lambda t: re.fullmatch(r"The answer is [0-9]\.", t)),
    ]:
        for temperature in (0.0, 1.0):
            r = client.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": "Answer."}],
                max_tokens=60,
                temperature=temperature,
                extra_body=body,
            )
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop", (body, text)
            assert check(text), (body, text)


def test_n_samples_each_follow_the_schema(server, client):
    schema = SCHEMAS[3]
    r = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": USER}],
        response_format=_response_format(schema),
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        n=3,
    )
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), schema)


def test_bad_schema_and_grammar_are_400_naming_the_field(server, client):
    messages = [{"role": "user", "content": "x"}]
    for kwargs, field in [
        ({"response_format": _response_format({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]})}, "response_format"),
        ({"response_format": _response_format({"type": "no-such-type"})}, "response_format"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "start: undefined_rule"}}, "guided_grammar"),
        ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.model, messages=messages, max_tokens=5, **kwargs)
        error = e.value.body.get("error", e.value.body)
        assert error["param"] == field, (kwargs, error)


def test_a_grammar_that_fails_while_generating_is_a_400_naming_its_field(server, client):
    # Every instance of this schema nests forever: the grammar engine gives up partway
    # through the output. The client hears it as an error naming the field, not as a
    # cut-off answer, streamed or not, and every KV block comes back.
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    kwargs = dict(
        model=server.model,
        messages=[{"role": "user", "content": USER}],
        max_tokens=40,
        response_format=_response_format(endless),
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kwargs)
    error = e.value.body.get("error", e.value.body)
    assert error["param"] == "response_format" and error["code"] == "structured_output_failed", error
    assert "structured output failed while generating" in error["message"]
    with pytest.raises(openai.APIError) as e:
        for _ in client.chat.completions.create(stream=True, **kwargs):
            pass
    assert "structured output failed while generating" in str(e.value)
    server.wait_idle()
