"""OpenAI's Responses API (`POST /v1/responses`) with the official client: a response is
the chat completion of the same conversation (instructions as the system message, input
items as messages, function calls and their outputs included), whole or streamed as
typed events whose deltas add up to the final response; logprobs, structured output and
function tools as on chat; a kept response is continued by `previous_response_id` as
the whole conversation would be, read back and deleted; fields it cannot honour are a 400
naming them, and every request gives its KV blocks back."""

import json

import jsonschema
import openai
import pytest
import requests

pytestmark = pytest.mark.skipif(
    not hasattr(openai.OpenAI, "responses"), reason="this openai client has no Responses API"
)

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city", "parameters": WEATHER_PARAMETERS}


def _chat(client, server, messages, **kwargs):
    return client.chat.completions.create(model=server.model, messages=messages, temperature=0, **kwargs)


def test_a_response_is_the_chat_completion_of_its_conversation(server, client):
    r = client.responses.create(
        model=server.model, instructions="Answer briefly.", input="Name a colour.",
        max_output_tokens=24, temperature=0,
    )
    chat = _chat(client, server, [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."},
    ], max_tokens=24)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.created_at <= r.completed_at and r.service_tier == "default"
    assert r.reasoning.effort is None
    # The client's own types hold the whole response (usage details included).
    type(r).model_validate(r.model_dump())
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Answer briefly." and r.max_output_tokens == 24
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    expected_status = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert r.status == expected_status
    server.wait_idle()


def test_input_items_carry_a_whole_conversation(server, client):
    turns = [
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is 2 + 2?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    r = client.responses.create(model=server.model, input=turns, max_output_tokens=16, temperature=0)
    chat = _chat(client, server, [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
    ], max_tokens=16)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_max_output_tokens_makes_an_incomplete_response(server, client):
    r = client.responses.create(
        model=server.model, input="Write a long story about the sea.", max_output_tokens=5, temperature=0,
    )
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5
    assert r.output[0].status == "incomplete"


def test_a_streamed_response_adds_up_to_the_whole_one(server, client):
    kwargs = dict(model=server.model, input="Tell me about owls.", max_output_tokens=20, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == deltas
    # The client's own stream helper reads the same events to the same response.
    with client.responses.stream(**kwargs) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        helper = stream.get_final_response()
    assert text == helper.output_text == whole.output_text
    server.wait_idle()


def test_logprobs_are_the_chats(server, client):
    r = client.responses.create(
        model=server.model, input="Hi", max_output_tokens=6, temperature=0,
        include=["message.output_text.logprobs"], top_logprobs=3,
    )
    chat = _chat(client, server, [{"role": "user", "content": "Hi"}], max_tokens=6, logprobs=True, top_logprobs=3)
    got = r.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [g.token for g in got] == [w.token for w in want]
    for g, w in zip(got, want):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [t.token for t in g.top_logprobs] == [t.token for t in w.top_logprobs]
    streamed = [
        lp for e in client.responses.create(
            model=server.model, input="Hi", max_output_tokens=6, temperature=0,
            include=["message.output_text.logprobs"], top_logprobs=3, stream=True,
        ) if e.type == "response.output_text.delta" for lp in e.logprobs
    ]
    assert [s.token for s in streamed] == [g.token for g in got]


def test_structured_output_follows_the_schema(server, client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"], "additionalProperties": False}
    r = client.responses.create(
        model=server.model, input="Invent a name.", max_output_tokens=60, extra_body={"seed": 1},
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_function_tools_call_and_their_outputs_continue_the_conversation(server, client):
    ask = "What is the weather in Paris?"
    r = client.responses.create(
        model=server.model, input=ask, tools=[WEATHER], tool_choice="required", max_output_tokens=80, extra_body={"seed": 2},
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls, r.output
    for call in calls:
        assert call.name == "get_weather" and call.call_id and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    # Streamed: the arguments' deltas add up to the final call's.
    events = list(client.responses.create(
        model=server.model, input=ask, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80, extra_body={"seed": 2}, stream=True,
    ))
    final = events[-1].response
    streamed_calls = [o for o in final.output if o.type == "function_call"]
    assert streamed_calls
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == "".join(c.arguments for c in streamed_calls)
    jsonschema.validate(json.loads(streamed_calls[0].arguments), WEATHER_PARAMETERS)
    # The call and its output go back as input items; the model answers in text.
    follow = client.responses.create(
        model=server.model, tools=[WEATHER], max_output_tokens=30, temperature=0,
        input=[
            {"role": "user", "content": ask},
            {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name, "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 degrees"},
        ],
    )
    assert follow.output and follow.usage.input_tokens > r.usage.input_tokens
    server.wait_idle()


@pytest.mark.parametrize("fields, param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, "input"),
    ({"input": "x", "conversation": "conv_123"}, "conversation"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "max_output_tokens": 1_000_000}, "max_output_tokens"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "top_logprobs": 50}, "top_logprobs"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text"),
    # A schema that does not compile: named as the client sent it, not as chat's field.
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nope"}}}}, "text"),
])
def test_bad_fields_are_400_naming_them(server, client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.model, **fields)
    assert e.value.body["param"] == param, e.value.body
    server.wait_idle()


def test_a_kept_responses_input_items_are_listed(server, client):
    r = client.responses.create(
        model=server.model, max_output_tokens=2,
        input=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
        ],
    )
    # The openai client's own method: newest first, each item with an id and its text.
    items = list(client.responses.input_items.list(r.id))
    assert [(i.role, i.content[0].text) for i in items] == [("user", "Name a color."), ("system", "Answer briefly.")]
    assert all(i.type == "message" and i.id for i in items)
    oldest_first = client.responses.input_items.list(r.id, order="asc", limit=1)
    assert [i.role for i in oldest_first.data] == ["system"] and oldest_first.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=oldest_first.data[0].id)
    assert [i.role for i in rest.data] == ["user"] and not rest.has_more
    # A string input is one user message.
    s = client.responses.create(model=server.model, input="Hi", max_output_tokens=1)
    (only,) = client.responses.input_items.list(s.id)
    assert (only.role, only.content[0].type, only.content[0].text) == ("user", "input_text", "Hi")
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_items.list(r.id, limit=0)
    assert e.value.body["param"] == "limit"


def test_a_follow_up_continues_a_kept_response(server, client):
    """`previous_response_id` continues a kept response's conversation, as if it were
    sent whole; the kept response reads back as it was answered, and goes when deleted."""
    first = client.responses.create(
        model=server.model, instructions="Answer briefly.", input="Name a fruit.", max_output_tokens=12, temperature=0,
    )
    assert first.store is True
    follow = client.responses.create(
        model=server.model, previous_response_id=first.id, input="Name another.", max_output_tokens=12, temperature=0,
    )
    assert follow.previous_response_id == first.id
    # The same conversation sent whole (instructions are not inherited).
    whole = client.responses.create(
        model=server.model, max_output_tokens=12, temperature=0,
        input=[
            {"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Name another."},
        ],
    )
    assert follow.output_text == whole.output_text
    assert follow.usage.input_tokens == whole.usage.input_tokens
    # Streamed responses are kept too, and chains go on.
    events = list(client.responses.create(
        model=server.model, previous_response_id=follow.id, input="And a third?", max_output_tokens=8,
        temperature=0, stream=True,
    ))
    third = events[-1].response
    assert third.usage.input_tokens > follow.usage.input_tokens
    kept = client.responses.retrieve(third.id)
    assert kept.output_text == third.output_text and kept.id == third.id
    # Its events are not kept: replaying them is a 400 naming `stream`, not an empty stream.
    with pytest.raises(openai.BadRequestError) as e:
        list(client.responses.retrieve(third.id, stream=True))
    assert e.value.body["param"] == "stream"
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=server.model, previous_response_id=first.id, input="x")
    assert e.value.body["param"] == "previous_response_id"
    unkept = client.responses.create(model=server.model, input="Hi", max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_a_tool_call_continues_with_its_output(server, client):
    """A kept response's function call, answered with `function_call_output` in a
    follow-up, continues the conversation as the whole conversation would."""
    r = client.responses.create(
        model=server.model, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
        max_output_tokens=80, temperature=0,
    )
    call = next(o for o in r.output if o.type == "function_call")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees"}
    follow = client.responses.create(
        model=server.model, previous_response_id=r.id, input=[output], tools=[WEATHER],
        max_output_tokens=20, temperature=0,
    )
    whole = client.responses.create(
        model=server.model, tools=[WEATHER], max_output_tokens=20, temperature=0,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            output,
        ],
    )
    assert follow.usage.input_tokens == whole.usage.input_tokens
    assert [o.type for o in follow.output] == [o.type for o in whole.output]
    server.wait_idle()


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")


def test_a_client_that_leaves_mid_stream_frees_its_request(server):
    before = server.metrics()
    r = requests.post(
        server.base_url + "/v1/responses",
        json={"model": server.model, "input": "Tell me a very long story.", "max_output_tokens": 3000,
              "stream": True, "ignore_eos": True},
        headers=server.headers(), stream=True, timeout=60,
    )
    assert r.status_code == 200
    deltas = 0
    for line in r.iter_lines():
        if line == b"event: response.output_text.delta":
            deltas += 1
            if deltas == 5:
                break
    r.close()
    after = server.wait_idle(timeout_s=30)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 5 <= generated < 3000, "the request ran on after its client left"
