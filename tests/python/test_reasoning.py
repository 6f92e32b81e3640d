"""`--reasoning-parser` with the openai client, on the default model (which does not
think: its outputs are forced with a regex where a test needs tags): a chat output's
`<think>…</think>` becomes `reasoning`, streamed as `reasoning` deltas; thinking that
never closes is all reasoning; structured output waits for thinking to end, unless the
prompt closed it; the Responses API gives a `reasoning` item; completions stay raw."""

import pytest

from conftest import start_server, stop_server

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
STORY = [{"role": "user", "content": "Tell me a long story about a dragon."}]
THINK_THEN_ANSWER = r"<think>\nI add two and two\.\n</think>\n\nFour\."
# SmolLM2's template with a generation prompt whose thinking is closed, as Qwen3's
# template writes it for `enable_thinking: false`.
CLOSED_THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def qwen3():
    srv = start_server("--reasoning-parser", "qwen3")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def r1():
    srv = start_server("--reasoning-parser", "deepseek_r1")
    yield srv
    stop_server(srv)


def _chat(server, stream=False, messages=ASK, **kwargs):
    kwargs.setdefault("max_tokens", 40)
    return server.client().chat.completions.create(
        model=server.model, messages=messages, temperature=0, stream=stream, **kwargs
    )


def _streamed(stream):
    """A streamed choice's reasoning and content, each joined, and its finish reason."""
    reasoning, content, finish = [], [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        if getattr(delta, "reasoning", None) is not None:
            assert delta.reasoning_content == delta.reasoning
            reasoning.append(delta.reasoning)
        if delta.content:
            content.append(delta.content)
        finish = choice.finish_reason or finish
    return "".join(reasoning) or None, "".join(content) or None, finish


def test_thinking_becomes_reasoning_and_the_rest_content(qwen3):
    r = _chat(qwen3, extra_body={"guided_regex": THINK_THEN_ANSWER})
    message = r.choices[0].message
    assert message.reasoning == "I add two and two.\n"
    assert message.reasoning_content == message.reasoning
    assert message.content == "Four."
    assert r.choices[0].finish_reason == "stop"
    streamed = _streamed(_chat(qwen3, stream=True, extra_body={"guided_regex": THINK_THEN_ANSWER}))
    assert streamed == ("I add two and two.\n", "Four.", "stop")
    # Usage counts the thinking tokens (the tags' own included), streamed or not.
    thinking = r.usage.completion_tokens_details.reasoning_tokens
    assert 0 < thinking < r.usage.completion_tokens
    chunks = list(_chat(qwen3, stream=True, stream_options={"include_usage": True},
                        extra_body={"guided_regex": THINK_THEN_ANSWER}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking


def test_several_choices_stream_their_own_reasoning_with_every_tokens_logprobs(qwen3):
    kwargs = dict(n=2, logprobs=True, extra_body={"guided_regex": THINK_THEN_ANSWER})
    whole = _chat(qwen3, **kwargs)
    chunks = list(_chat(qwen3, stream=True, stream_options={"include_usage": True}, **kwargs))
    for i in range(2):
        mine = [c for c in chunks if c.choices and c.choices[0].index == i]
        assert _streamed(mine) == ("I add two and two.\n", "Four.", "stop")
        streamed_logprobs = [e for c in mine if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert [e.token for e in streamed_logprobs] == [e.token for e in whole.choices[i].logprobs.content]
    assert len(whole.choices[0].logprobs.content) * 2 == whole.usage.completion_tokens


def test_an_output_without_thinking_is_all_content(qwen3, server):
    plain_response = _chat(server)
    assert plain_response.usage.completion_tokens_details is None  # no parser, no details
    plain = plain_response.choices[0].message.content
    r = _chat(qwen3)
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    message = r.choices[0].message
    assert message.content == plain and plain
    assert message.reasoning is None and message.reasoning_content is None
    assert _streamed(_chat(qwen3, stream=True))[:2] == (None, plain)
    # Completions stay raw text.
    choice = qwen3.client().completions.create(
        model=qwen3.model,
        prompt="2 + 2 =",
        max_tokens=40,
        temperature=0,
        extra_body={"guided_regex": THINK_THEN_ANSWER},
    ).choices[0]
    assert choice.text == "<think>\nI add two and two.\n</think>\n\nFour."
    assert "reasoning" not in choice.model_dump()


def test_a_tag_inside_the_prompt_is_not_the_outputs(qwen3, server):
    # A user's text, or an earlier turn, that holds `<think>` leaves the output's start
    # alone: only how the prompt ends counts.
    for messages in (
        [{"role": "user", "content": "<think> is an HTML-like tag. Reply with one word: hello"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\n"},
         {"role": "user", "content": "Say hello."}],
    ):
        plain = _chat(server, messages=messages, max_tokens=8).choices[0].message.content
        message = _chat(qwen3, messages=messages, max_tokens=8).choices[0].message
        assert (message.reasoning, message.content) == (None, plain)


def test_thinking_that_never_closes_is_all_reasoning(r1, server):
    plain = _chat(server, messages=STORY, max_tokens=12).choices[0].message.content
    r = _chat(r1, messages=STORY, max_tokens=12)
    assert r.usage.completion_tokens_details.reasoning_tokens == 12
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content is None
    assert r.choices[0].message.reasoning == plain.lstrip()
    streamed = _streamed(_chat(r1, stream=True, messages=STORY, max_tokens=12))
    assert streamed == (plain.lstrip(), None, "length")


def test_structured_output_waits_for_thinking_to_end(r1, server):
    # R1's outputs begin thinking: the grammar waits for `</think>`, which this model
    # never writes, so the output is the unconstrained one, all reasoning.
    plain = _chat(server, messages=STORY, max_tokens=12).choices[0].message.content
    r = _chat(r1, messages=STORY, max_tokens=12, extra_body={"guided_regex": r"Four\."})
    assert r.choices[0].message.reasoning == plain.lstrip()
    assert r.choices[0].message.content is None
    # A prompt that closed its thinking is constrained from its first token.
    r = _chat(
        r1,
        max_tokens=12,
        extra_body={"guided_regex": r"Four\.", "chat_template": CLOSED_THINKING_TEMPLATE},
    )
    assert r.choices[0].message.content == "Four."
    assert r.choices[0].message.reasoning is None


def test_a_reasoning_message_goes_back_into_the_conversation(qwen3):
    first = _chat(qwen3, extra_body={"guided_regex": THINK_THEN_ANSWER}).choices[0].message
    turns = ASK + [first.model_dump(exclude_none=True), {"role": "user", "content": "And 3 + 3?"}]
    r = qwen3.client().chat.completions.create(
        model=qwen3.model, messages=turns, max_tokens=8, temperature=0
    )
    assert r.choices[0].message.content


def test_responses_give_a_reasoning_item(r1, qwen3):
    kwargs = dict(input=STORY[0]["content"], max_output_tokens=12, temperature=0)
    r = r1.client().responses.create(model=r1.model, reasoning={"effort": "low"}, **kwargs)
    assert r.reasoning.effort == "low"  # echoed; the template's `reasoning_effort`
    chat = _chat(r1, messages=STORY, max_tokens=12).choices[0].message.reasoning
    assert [item.type for item in r.output] == ["reasoning"]
    assert r.output[0].content[0].type == "reasoning_text"
    assert r.output[0].content[0].text == chat
    assert r.status == "incomplete" and r.output[0].status == "incomplete"
    # Every token was thinking.
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 12
    assert r.usage.input_tokens_details.cache_write_tokens == 0
    events = list(r1.client().responses.create(model=r1.model, stream=True, **kwargs))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == chat
    done = [e for e in events if e.type == "response.completed"][0].response
    assert [item.type for item in done.output] == ["reasoning"]
    assert done.output[0].content[0].text == chat
    assert done.usage.output_tokens_details.reasoning_tokens == 12
    # No thinking: the message alone, with its logprobs.
    r = qwen3.client().responses.create(model=qwen3.model, **kwargs)
    assert [item.type for item in r.output] == ["message"]
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_startup_refuses_an_unknown_parser_and_warns_of_a_model_without_tags(tmp_path):
    log = tmp_path / "stderr"
    with open(log, "w") as f, pytest.raises(RuntimeError, match="exited early"):
        start_server("--reasoning-parser", "granite", stderr=f)
    assert 'unknown reasoning parser "granite"; lantern knows deepseek_r1, qwen3' in log.read_text()
    # A model whose tokenizer has no tag tokens is likely no thinking model: said once.
    with open(log, "w") as f:
        stop_server(start_server("--reasoning-parser", "qwen3", stderr=f))
    assert "writes </think> as 3 tokens" in log.read_text()
