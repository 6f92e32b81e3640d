"""lm-evaluation-harness against `lantern serve`: what its `local-completions` model asks.

Its `remote` tokenizer (chosen on its own when `/tokenizer_info` answers) reads the special
tokens and the chat template from `GET /tokenizer_info` and tokenizes through `/tokenize`
and `/detokenize`, so no copy of the tokenizer is needed where lm-eval runs. A
loglikelihood is a completion of the context's and the continuation's token ids with
`echo`, `logprobs: 1` and `max_tokens: 1`, read as the sum of `token_logprobs[ctxlen:-1]`,
greedy when each of those is its row's top logprob; a generation is a completion of the
context's ids with `stop`. The last test runs lm-eval itself where it is installed
(`pip install "lm_eval[api]"`), on a task written here with local data.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import requests

from conftest import detokenize, tokenize

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def tokenizer_info(server):
    r = requests.get(server.base_url + "/tokenizer_info", headers=server.headers(), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def encode(server, text):
    """As lm-eval's remote tokenizer encodes: no special tokens added."""
    return tokenize(server, prompt=text, add_special_tokens=False)


def echoed(server, prompts):
    """The completion lm-eval asks for to score token-id `prompts`: each echoed with its
    logprobs, one token generated."""
    body = {
        "model": server.model,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    r = requests.post(
        server.base_url + "/v1/completions", json=body, headers=server.headers(), timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json()


def score(server, requests_):
    """lm-eval's loglikelihood of each (context ids, continuation ids), batched in one
    request as it batches them: [(sum of logprobs, greedy)]."""
    out = []
    response = echoed(server, [ctx + cont for ctx, cont in requests_])
    choices = sorted(response["choices"], key=lambda c: c["index"])
    for choice, (ctx, cont) in zip(choices, requests_):
        logprobs = choice["logprobs"]
        # The echoed prompt, then the one generated token.
        assert len(logprobs["token_logprobs"]) == len(ctx) + len(cont) + 1
        picked = logprobs["token_logprobs"][len(ctx) : -1]
        tops = logprobs["top_logprobs"][len(ctx) : -1]
        greedy = all(lp == max(top.values()) for lp, top in zip(picked, tops))
        out.append((sum(picked), greedy))
    return out


def test_tokenizer_info_names_the_special_tokens_and_the_template(server):
    info = tokenizer_info(server)
    # SmolLM2's GGUF: ChatML's markers.
    assert info["bos_token"] == "<|im_start|>"
    assert info["eos_token"] == "<|im_end|>"
    assert info["add_bos_token"] is False
    assert info["model_max_length"] == server.context_length
    assert info["vocab_size"] == 49152
    # One token each, as lm-eval's `eos_token_id` takes the first id of its encoding.
    assert len(encode(server, info["eos_token"])) == 1
    assert len(encode(server, info["bos_token"])) == 1
    # The template the server renders chat with: rendered by Jinja2, as lm-eval's remote
    # tokenizer renders it, it gives the same prompt.
    jinja2 = pytest.importorskip("jinja2")
    rendered = (
        jinja2.Environment()
        .from_string(info["chat_template"])
        .render(
            messages=QUESTION,
            add_generation_prompt=True,
            bos_token=info["bos_token"],
            eos_token=info["eos_token"],
        )
    )
    assert rendered == detokenize(server, tokenize(server, messages=QUESTION))


def test_tokenizer_info_needs_the_api_key(server):
    r = requests.get(server.base_url + "/tokenizer_info", timeout=30)
    assert r.status_code == 401, r.text


def test_the_remote_tokenizer_round_trips_text(server):
    text = "Interpretability: the model's attention, 12 heads × 30 layers — exact."
    ids = encode(server, text)
    assert detokenize(server, ids) == text
    # Batches of texts encode one by one, each as it encodes alone.
    assert encode(server, "The capital of France is") + encode(server, " Paris") == encode(
        server, "The capital of France is Paris"
    )


def test_tokenize_returns_the_tokens_as_the_vocabulary_spells_them(server):
    body = {"prompt": "Hello world\n", "add_special_tokens": False, "return_token_strs": True}
    r = requests.post(server.base_url + "/tokenize", json=body, headers=server.headers(), timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    # SmolLM2's byte-level BPE: a leading space is `Ġ`, a newline `Ċ`.
    assert out["token_strs"] == ["Hello", "Ġworld", "Ċ"] and len(out["tokens"]) == 3
    plain = requests.post(
        server.base_url + "/tokenize", json={"prompt": "Hello"}, headers=server.headers(), timeout=30
    ).json()
    assert "token_strs" not in plain


def test_loglikelihood_of_the_greedy_continuation_is_greedy_and_matches_generation(
    server,
):
    context = encode(server, "The capital of France is")
    # The model's own greedy continuation, with each token's logprob.
    r = requests.post(
        server.base_url + "/v1/completions",
        json={
            "model": server.model,
            "prompt": context,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
        },
        headers=server.headers(),
        timeout=120,
    )
    assert r.status_code == 200, r.text
    generated = r.json()["choices"][0]["logprobs"]
    continuation = [int(t.removeprefix("token_id:")) for t in generated["tokens"]]
    assert len(continuation) == 6
    expected = sum(generated["token_logprobs"])

    other = encode(server, " Berlin")
    assert len(other) == 1
    [(greedy_ll, greedy), (first_ll, first_greedy), (other_ll, other_greedy)] = score(
        server, [(context, continuation), (context, continuation[:1]), (context, other)]
    )
    assert greedy and first_greedy, "the greedy continuation scored as not greedy"
    # Scoring the continuation in one prefill and generating it step by step agree.
    assert math.isclose(greedy_ll, expected, rel_tol=1e-3, abs_tol=1e-3), (greedy_ll, expected)
    assert math.isclose(first_ll, generated["token_logprobs"][0], rel_tol=1e-3, abs_tol=1e-3)
    assert not other_greedy
    assert other_ll < first_ll


def test_loglikelihoods_batched_equal_one_at_a_time(server):
    context = encode(server, "Question: What is the capital of Italy?\nAnswer:")
    choices = [encode(server, " " + c) for c in ("Athens", "Bern", "Rome", "Paris")]
    together = score(server, [(context, c) for c in choices])
    alone = [score(server, [(context, c)])[0] for c in choices]
    assert together == alone
    # The right answer is the most likely: what an accuracy metric reads.
    lls = [ll for ll, _ in together]
    assert lls.index(max(lls)) == 2, lls


def test_scoring_after_a_shared_context_takes_the_prefix_cache(server):
    # A few-shot context long enough for several cache blocks, unique to this test.
    shots = "".join(
        f"Question: What is {a} plus {b}?\nAnswer: {a + b}\n\n" for a, b in [(2, 3), (7, 1), (4, 4), (9, 6)]
    )
    context = encode(server, shots + "Question: What is 5 plus 3?\nAnswer:")
    choices = [encode(server, " " + c) for c in ("8", "7", "9", "53")]

    def one(choice):
        out = echoed(server, context + choice)
        return out["choices"][0]["logprobs"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

    # One at a time, as lm-eval sends them by default.
    first = [one(c) for c in choices]
    assert first[0][1] == 0, "a context never seen before was cached"
    # The later choices hit the context's blocks (16 tokens each), all but the last of
    # them: its row scores the first token after the hit.
    assert all(cached >= len(context) // 16 * 16 - 16 for _, cached in first[1:]), first
    again, cached = one(choices[0])
    assert cached > 0
    # Rows from the cache are the rows computed: every logprob, alternative and token.
    assert again == first[0][0]
    lls = [sum(lp["token_logprobs"][len(context) : -1]) for lp, _ in first]
    assert lls.index(max(lls)) == 0, lls


def test_choices_scored_in_one_batch_compute_their_context_once(server):
    # lm-eval with batch_size > 1 sends a question's choices in one request; they start
    # in the same step, and all but one take the shared context from the prefix cache
    # once the first has computed it (instead of computing it each).
    shots = "".join(
        f"Question: Which is larger, {a} or {b}?\nAnswer: {max(a, b)}\n\n"
        for a, b in [(31, 17), (5, 12), (88, 90), (41, 14)]
    )
    context = encode(server, shots + "Question: Which is larger, 23 or 32?\nAnswer:")
    choices = [encode(server, " " + c) for c in ("32", "23", "55", "5")]
    out = echoed(server, [context + c for c in choices])
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The context's full blocks of 16 tokens, less the last (its row scores the first
    # token after the hit), for each choice after the first.
    assert cached >= 3 * (len(context) // 16 * 16 - 16), (cached, len(context))
    one_by_one = [echoed(server, [context + c])["choices"][0]["logprobs"] for c in choices]
    assert [c["logprobs"] for c in sorted(out["choices"], key=lambda c: c["index"])] == one_by_one


def test_generation_stops_as_lm_eval_asks(server):
    body = {
        "model": server.model,
        "prompt": [encode(server, "The capital of Japan is")],
        "max_tokens": 16,
        "temperature": 0,
        "stop": ["\n", "."],
        "seed": 1234,
    }
    r = requests.post(
        server.base_url + "/v1/completions", json=body, headers=server.headers(), timeout=120
    )
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["text"].strip() == "Tokyo", choice
    assert choice["finish_reason"] == "stop"


CAPITALS = [
    ("France", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Germany", ["Lisbon", "Berlin", "Vienna", "Oslo"], 1),
    ("Italy", ["Athens", "Bern", "Rome", "Paris"], 2),
    ("Japan", ["Seoul", "Beijing", "Bangkok", "Tokyo"], 3),
]

TASKS = {
    "lantern_capitals_mc": """
task: lantern_capitals_mc
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "lantern_capitals_gen": """
task: lantern_capitals_gen
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: generate_until
doc_to_text: "The capital of {{{{country}}}} is"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
filter_list:
  - name: strip
    filter:
      - function: regex
        regex_pattern: "\\\\s*([A-Za-z]+)"
      - function: take_first
""",
}


def test_lm_eval_runs_against_the_server(server, tmp_path):
    pytest.importorskip("lm_eval", reason='lm-eval is not installed (pip install "lm_eval[api]")')
    data = tmp_path / "capitals.jsonl"
    data.write_text(
        "".join(
            json.dumps({"country": c, "choices": ch, "answer": a}) + "\n" for c, ch, a in CAPITALS
        )
    )
    for name, text in TASKS.items():
        (tmp_path / f"{name}.yaml").write_text(text.format(data=data))
    out = tmp_path / "out"
    model_args = ",".join(
        [
            f"model={server.model}",
            f"base_url={server.base_url}/v1/completions",
            f"auth_token={server.api_key}",
            "num_concurrent=2",
            "max_retries=1",
        ]
    )
    env = dict(
        os.environ,
        OPENAI_API_KEY=server.api_key,
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path / "datasets"),
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
            model_args,
            "--tasks",
            ",".join(TASKS),
            "--include_path",
            str(tmp_path),
            "--batch_size",
            "2",
            "--output_path",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    # It found the remote tokenizer on its own (no Hugging Face download).
    assert "remote tokenizer" in run.stderr, run.stderr[-4000:]
    [results] = list(out.rglob("results_*.json"))
    scores = json.loads(results.read_text())["results"]
    assert scores["lantern_capitals_mc"]["acc,none"] == 1.0, scores
    assert scores["lantern_capitals_gen"]["exact_match,strip"] == 1.0, scores
