"""gpt-oss's harmony replies through a real `lantern serve` and the openai client: the
`analysis` channel becomes `reasoning`, `final` (and a preamble to no one) the content,
a message to `functions.NAME` a tool call, streamed and not, on chat completions (the
Responses API's items from the same split are unit-tested in lantern-server: its
structured output takes JSON schemas only, which cannot force a harmony reply here). A
vocabulary whose harmony markers are control tokens has its replies read
so without `--reasoning-parser`, its markers kept in the text the parser reads whatever
`skip_special_tokens` says.

The model is the tiny gpt-oss checkpoint of tests/fixtures/archs with seven of its
vocabulary's unused control tokens renamed to harmony's markers (gpt-oss's own vocabulary
has 201k tokens). Its random weights write no harmony, so the replies are forced by a Lark
grammar whose `<|…|>` terms are those control tokens; its chat template is SmolLM2's,
whose prompt ends outside any harmony header, so the grammar holds from the first token."""

import json
import shutil

import pytest

from conftest import ROOT, detokenize, start_server, stop_server, tokenize

FIXTURE = ROOT / "tests/fixtures/archs/gpt_oss/hf"
MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
# Ids 3.. are SmolLM2's `<repo_name>`, `<reponame>`, ...: control tokens no test writes.
FIRST_RENAMED = 3

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
REPLY = (
    'start: <|channel|> "analysis" <|message|> "I add two and two." <|end|> '
    '<|start|> "assistant" <|channel|> "final" <|message|> "Four."'
)
CALL = (
    'start: <|channel|> "analysis" <|message|> "Need the weather." <|end|> '
    '<|start|> "assistant" <|channel|> "commentary to=functions.get_weather " <|constrain|> "json" '
    '<|message|> "{\\"city\\": \\"Oslo\\"}" <|call|>'
)
PREAMBLE = (
    'start: <|channel|> "commentary" <|message|> "Let me think." <|end|> '
    '<|start|> "assistant" <|channel|> "analysis" <|message|> "Two and two." <|end|> '
    '<|start|> "assistant" <|channel|> "final" <|message|> "Four."'
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _harmony_checkpoint(directory):
    shutil.copytree(FIXTURE, directory)
    path = directory / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    for offset, marker in enumerate(MARKERS):
        token = tokenizer["added_tokens"][FIRST_RENAMED + offset]
        assert token["id"] == FIRST_RENAMED + offset and token["special"]
        del vocab[token["content"]]
        vocab[marker] = token["id"]
        token["content"] = marker
    path.write_text(json.dumps(tokenizer))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for offset, marker in enumerate(MARKERS):
        config["added_tokens_decoder"][str(FIRST_RENAMED + offset)]["content"] = marker
    config_path.write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    directory = _harmony_checkpoint(tmp_path_factory.mktemp("harmony") / "hf")
    log = directory.parent / "stderr"
    with open(log, "w") as f:
        srv = start_server("--model", str(directory), stderr=f)
    srv.log = log
    yield srv
    stop_server(srv)


def _chat(server, grammar, stream=False, **kwargs):
    kwargs.setdefault("max_tokens", 60)
    extra = kwargs.pop("extra_body", {})
    return server.client().chat.completions.create(
        model=server.model, messages=ASK, temperature=0, stream=stream,
        extra_body={"guided_grammar": grammar, **extra}, **kwargs,
    )


def _streamed(stream):
    """A streamed choice's reasoning and content (each joined), its calls (merged by
    index) and its finish reason."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning += getattr(delta, "reasoning", None) or ""
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name, d
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return reasoning or None, content or None, [tuple(c) for _, c in sorted(calls.items())], finish


def test_the_vocabulary_implies_the_parser(harmony):
    assert "reasoning parser openai_gptoss" in harmony.log.read_text()


def test_analysis_is_reasoning_and_final_the_content(harmony):
    r = _chat(harmony, REPLY)
    message = r.choices[0].message
    assert (message.reasoning, message.content) == ("I add two and two.", "Four.")
    assert message.reasoning_content == message.reasoning
    assert message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    thinking = r.usage.completion_tokens_details.reasoning_tokens
    assert 0 < thinking < r.usage.completion_tokens
    # The markers are control tokens: read whatever the request says of them.
    kept = _chat(harmony, REPLY, extra_body={"skip_special_tokens": True}).choices[0].message
    assert (kept.reasoning, kept.content) == (message.reasoning, message.content)
    assert _streamed(_chat(harmony, REPLY, stream=True)) == ("I add two and two.", "Four.", [], "stop")


def test_a_message_to_a_function_is_a_tool_call(harmony):
    for tools in ({"tools": [WEATHER]}, {}):
        r = _chat(harmony, CALL, **tools)
        choice = r.choices[0]
        assert choice.message.reasoning == "Need the weather."
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
        assert call.id and call.type == "function"
        assert choice.finish_reason == "tool_calls"
        streamed = _streamed(_chat(harmony, CALL, stream=True, **tools))
        assert streamed == ("Need the weather.", None, [("get_weather", '{"city": "Oslo"}')], "tool_calls")


def test_a_preamble_is_content_and_messages_of_a_kind_are_joined(harmony):
    r = _chat(harmony, PREAMBLE)
    message = r.choices[0].message
    assert (message.reasoning, message.content) == ("Two and two.", "Let me think.\nFour.")
    assert _streamed(_chat(harmony, PREAMBLE, stream=True))[:2] == ("Two and two.", "Let me think.\nFour.")


def test_a_reply_cut_short_keeps_its_reasoning(harmony):
    r = _chat(harmony, REPLY, max_tokens=6)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None
    assert choice.message.reasoning and "I add two and two.".startswith(choice.message.reasoning)


def test_completions_stay_raw_text(harmony):
    choice = harmony.client().completions.create(
        model=harmony.model, prompt="2 + 2 =", max_tokens=60, temperature=0,
        extra_body={"guided_grammar": REPLY, "skip_special_tokens": False},
    ).choices[0]
    assert choice.text == (
        "<|channel|>analysis<|message|>I add two and two.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Four."
    )


def test_a_grammar_waits_for_the_final_channel(harmony):
    # gpt-oss's template ends the prompt in the reply's header: the grammar applies to the
    # final channel's content only, so before it (this model never writes it) the output
    # is the unconstrained one.
    template = (ROOT / "tests/fixtures/chat_templates/gpt_oss.jinja").read_text()
    kwargs = dict(max_tokens=8, logprobs=True, extra_body={"chat_template": template})
    plain = harmony.client().chat.completions.create(
        model=harmony.model, messages=ASK, temperature=0, **kwargs
    ).choices[0]
    kwargs["extra_body"]["guided_regex"] = "Four\\."
    guided = harmony.client().chat.completions.create(
        model=harmony.model, messages=ASK, temperature=0, **kwargs
    ).choices[0]
    assert [t.token for t in guided.logprobs.content] == [t.token for t in plain.logprobs.content]


def test_reasoning_given_back_is_written_before_its_call(harmony):
    # A tool loop's next request: the assistant's reasoning before its call goes back
    # into gpt-oss's template (as `thinking`), which writes it as the analysis message.
    first = _chat(harmony, CALL).choices[0].message
    turns = ASK + [
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny"},
    ]
    template = (ROOT / "tests/fixtures/chat_templates/gpt_oss.jinja").read_text()
    ids = tokenize(harmony, messages=turns, chat_template=template)
    text = detokenize(harmony, ids)
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>assistant"
    ) in text, text
    # The next reply follows it as any other.
    r = harmony.client().chat.completions.create(
        model=harmony.model, messages=turns, max_tokens=4, temperature=0,
        extra_body={"chat_template": template},
    )
    assert r.usage.prompt_tokens == len(ids)


def test_the_reasoning_effort_reaches_the_system_message(harmony):
    template = (ROOT / "tests/fixtures/chat_templates/gpt_oss.jinja").read_text()
    for effort in ("low", "high"):
        ids = tokenize(harmony, messages=ASK, chat_template=template, reasoning_effort=effort)
        assert f"Reasoning: {effort}" in detokenize(harmony, ids)
    # The openai client's own argument; the Responses API's `reasoning.effort`.
    r = harmony.client().chat.completions.create(
        model=harmony.model, messages=ASK, max_tokens=1, reasoning_effort="high",
        extra_body={"chat_template": template},
    )
    assert r.usage.prompt_tokens == len(tokenize(harmony, messages=ASK, chat_template=template,
                                                  reasoning_effort="high"))
    r = harmony.client().responses.create(
        model=harmony.model, input=ASK[0]["content"], max_output_tokens=1, reasoning={"effort": "high"},
        extra_body={"chat_template": template},
    )
    assert r.reasoning.effort == "high"


def test_responses_give_reasoning_items_back_to_the_template(harmony):
    # The Responses API's items of a tool loop, given back as input: the reasoning goes
    # with the call after it, as chat's assistant message with `reasoning` does.
    template = (ROOT / "tests/fixtures/chat_templates/gpt_oss.jinja").read_text()
    items = [
        {"role": "user", "content": ASK[0]["content"]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Need the weather."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    r = harmony.client().responses.create(
        model=harmony.model, input=items, max_output_tokens=1, extra_body={"chat_template": template},
    )
    chat = ASK + [
        {"role": "assistant", "content": "", "reasoning": "Need the weather.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    ids = tokenize(harmony, messages=chat, chat_template=template)
    assert "<|channel|>analysis<|message|>Need the weather.<|end|>" in detokenize(harmony, ids)
    assert r.usage.input_tokens == len(ids)
