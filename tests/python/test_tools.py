"""Tool calling with the openai client: `required` and named choices always produce a
call valid against the function's parameters, `auto` answers with text or a call, tool
results and assistant calls go back into the conversation; streamed and not."""

import json

import jsonschema
import openai
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls, names):
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(stream):
    """Content, tool calls (merged by index) and finish reason of a streamed choice."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_choices_always_call(server, client, temperature):
    for choice, names in [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ]:
        r = client.chat.completions.create(
            model=server.model, messages=ASK, tools=TOOLS, tool_choice=choice,
            max_tokens=200, temperature=temperature, seed=3,
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        _check_calls(c.message.tool_calls, names)


def test_streamed_calls(server, client):
    stream = client.chat.completions.create(
        model=server.model, messages=ASK, tools=TOOLS, tool_choice="required",
        max_tokens=200, temperature=0.0, stream=True,
    )
    content, calls, finish = _streamed(stream)
    assert finish == "tool_calls" and content == ""
    for call in calls.values():
        assert call["id"] and call["name"] in SCHEMAS
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_answers_with_text_or_a_valid_call(server, client, stream):
    kwargs = dict(model=server.model, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=60, temperature=0.0)
    if stream:
        content, calls, finish = _streamed(client.chat.completions.create(stream=True, **kwargs))
    else:
        c = client.chat.completions.create(**kwargs).choices[0]
        content, finish = c.message.content or "", c.finish_reason
        calls = {i: {"name": t.function.name, "arguments": t.function.arguments} for i, t in enumerate(c.message.tool_calls or [])}
    if calls:
        assert finish == "tool_calls"
        for call in calls.values():
            json.loads(call["arguments"])
    else:
        assert finish in ("stop", "length") and content and "<tool_call>" not in content


def test_a_tool_result_conversation_continues(server, client):
    first = client.chat.completions.create(
        model=server.model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0.0,
    ).choices[0].message
    call = first.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    r = client.chat.completions.create(
        model=server.model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0.0,
    )
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length") and c.message.content and not c.message.tool_calls


def test_bad_tools_are_400(server, client):
    for kwargs, field in [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.model, messages=ASK, max_tokens=5, **kwargs)
        error = e.value.body.get("error", e.value.body)
        assert error["param"] == field, (kwargs, error)
