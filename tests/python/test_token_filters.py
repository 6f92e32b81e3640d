"""vLLM's `allowed_token_ids`, `bad_words` and `skip_special_tokens` through the official
`openai` client (`extra_body`), on both endpoints: sampled tokens stay in the allowed
set, a banned word never appears (its last token is banned where the output ends with
its others), special tokens get their text on request, and a filter that leaves nothing
to sample is a 400 naming its field."""

import re

import openai
import pytest

from conftest import one_token, tokenize

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def token_ids(choice):
    """The generated token ids of a choice asked with `return_tokens_as_token_ids`."""
    tokens = choice.logprobs.tokens if hasattr(choice.logprobs, "tokens") else [
        c.token for c in choice.logprobs.content
    ]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def spellings(server, word):
    """The token sequences `bad_words` bans for `word` (at the start, after a space)."""
    return [tokenize(server, prompt=w, add_special_tokens=False) for w in (word, " " + word)]


def contains(ids, seq):
    return any(ids[i : i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def test_allowed_token_ids_keep_sampling_inside_the_set(server, client):
    yes, no = one_token(server, " yes"), one_token(server, " no")
    r = client.completions.create(
        model=server.model, prompt="Answer:", max_tokens=6, temperature=1.0, n=4, seed=3,
        extra_body={"allowed_token_ids": [yes, no]},
    )
    for choice in r.choices:
        assert re.fullmatch(r"( yes| no)+", choice.text), choice.text
    c = client.chat.completions.create(
        model=server.model, messages=QUESTION, max_tokens=4, temperature=0,
        extra_body={"allowed_token_ids": [no]},
    )
    assert c.choices[0].message.content == " no" * 4


def test_bad_words_are_never_generated(server, client):
    kwargs = dict(model=server.model, prompt="The capital of France is", max_tokens=12, temperature=0)
    greedy = client.completions.create(**kwargs)
    assert "Paris" in greedy.choices[0].text
    banned = client.completions.create(**kwargs, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned.choices[0].text
    c = client.chat.completions.create(
        model=server.model, messages=QUESTION, max_tokens=12, temperature=0,
        extra_body={"bad_words": ["Paris"]},
    )
    assert "Paris" not in c.choices[0].message.content


def test_a_many_token_bad_word_bans_only_its_last_token_after_the_others(server, client):
    kwargs = dict(
        model=server.model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    greedy = client.completions.create(**kwargs)
    ids = token_ids(greedy.choices[0])
    word = greedy.choices[0].text.strip().split()[1]  # "6," of " 5, 6, 7, ..."
    sequences = spellings(server, word)
    assert any(len(s) > 1 and contains(ids, s) for s in sequences), (word, sequences, ids)
    kwargs["extra_body"]["bad_words"] = [word]
    banned = client.completions.create(**kwargs)
    banned_ids = token_ids(banned.choices[0])
    assert banned_ids != ids
    for s in sequences:
        assert not contains(banned_ids, s), (word, s, banned_ids)


def test_skip_special_tokens_false_gives_special_tokens_their_text(server, client):
    im_start = one_token(server, "<|im_start|>")
    texts = {}
    for skip in (True, False):
        r = client.completions.create(
            model=server.model, prompt="Hello", max_tokens=2, temperature=0,
            extra_body={"allowed_token_ids": [im_start], "skip_special_tokens": skip},
        )
        assert r.usage.completion_tokens == 2
        texts[skip] = r.choices[0].text
    assert texts == {True: "", False: "<|im_start|><|im_start|>"}


def test_a_filter_that_leaves_no_token_is_400_naming_its_field(server, client):
    yes = one_token(server, " yes")
    bad = [
        ({"allowed_token_ids": []}, "allowed_token_ids", "at least one token"),
        ({"allowed_token_ids": [10**8]}, "allowed_token_ids", "vocabulary"),
        ({"allowed_token_ids": [yes], "bad_words": ["yes"]}, "bad_words", "every token"),
        # Allowed at first; after one " yes", the two-token word bans the only token.
        ({"allowed_token_ids": [yes], "bad_words": ["yes yes"]}, "bad_words", "no token to sample"),
    ]
    for fields, param, what in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(
                model=server.model, prompt="Answer:", max_tokens=3, temperature=0, extra_body=fields
            )
        assert e.value.body["param"] == param, fields
        assert what in e.value.body["message"], (fields, e.value.body)
    # The server goes on serving.
    r = client.completions.create(model=server.model, prompt="Answer:", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
