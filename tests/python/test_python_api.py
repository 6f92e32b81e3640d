"""The Python API (`import lantern`, crates/lantern-python) against the server and the
CLI: the same requests generate the same tokens, captures are the server's bit for bit,
bad parameters raise naming the field, and an interrupted generation gives back every
KV block. scripts/test-python builds and installs the wheel before running these."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

import lantern
import lantern_attn
from conftest import _binary, start_server, stop_server

PROMPTS = ["The lighthouse keeper climbed the narrow stairs and", "def fibonacci(n):"]
MESSAGES = [{"role": "user", "content": "Name three colours of the sea."}]
MAX_TOKENS = 12
SEEDED = dict(temperature=0.8, top_p=0.9, top_k=40, seed=1234)


@pytest.fixture(scope="module")
def srv():
    server = start_server("--enable-attention-capture", api_key=None)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def llm():
    engine = lantern.LLM(kv_cache_memory="256M")
    yield engine
    engine.close()


def cli_generate(*flags) -> list:
    out = subprocess.run(
        [str(_binary()), "generate", "--json", *map(str, flags)],
        capture_output=True, text=True, timeout=300, check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines()]


# Fields the openai client takes as arguments; the others go in extra_body.
OPENAI_FIELDS = {"temperature", "top_p", "seed", "max_tokens", "logprobs", "n", "extra_body"}


def openai_args(fields):
    args = {k: v for k, v in fields.items() if k in OPENAI_FIELDS}
    extra = {k: v for k, v in fields.items() if k not in OPENAI_FIELDS}
    args["extra_body"] = {**extra, **args.get("extra_body", {})}
    return args


def server_completions(srv, prompt, **fields):
    return srv.client().completions.create(model=srv.model, prompt=prompt, **openai_args(fields))


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_generations_equal_the_servers_and_the_clis(llm, srv, sampling):
    fields = {"temperature": 0} if sampling == "greedy" else SEEDED
    outs = llm.generate(PROMPTS, lantern.SamplingParams(max_tokens=MAX_TOKENS, **fields))
    assert [o.prompt for o in outs] == PROMPTS
    cli_flags = [a for p in PROMPTS for a in ("--prompt", p)]
    cli_flags += ["--max-tokens", MAX_TOKENS]
    for name, value in fields.items():
        cli_flags += [f"--{name.replace('_', '-')}", value]
    cli = cli_generate(*cli_flags)
    for out, line, prompt in zip(outs, cli, PROMPTS):
        (seq,) = out.outputs
        assert out.finished and seq.finish_reason == line["finish_reason"]
        assert out.prompt_token_ids == line["prompt_token_ids"]
        assert seq.token_ids == line["token_ids"]
        assert seq.text == line["text"]
        served = server_completions(srv, prompt, max_tokens=MAX_TOKENS, **fields).choices[0]
        assert seq.text == served.text
        assert seq.finish_reason == served.finish_reason
        assert out.metrics.arrival_time <= out.metrics.first_token_time <= out.metrics.finished_time


def test_chat_and_n_equal_the_servers(llm, srv):
    params = lantern.SamplingParams(n=2, max_tokens=MAX_TOKENS, **SEEDED)
    (out,) = llm.chat(MESSAGES, params)
    served = srv.client().chat.completions.create(
        model=srv.model, messages=MESSAGES, **openai_args(dict(n=2, max_tokens=MAX_TOKENS, **SEEDED))
    )
    assert [o.text for o in out.outputs] == [c.message.content for c in served.choices]
    assert out.outputs[0].text != out.outputs[1].text  # two samples, two seeds
    assert "Name three colours" in out.prompt  # the rendered template
    # Several conversations: one batch, results in input order.
    other = [{"role": "user", "content": "Hi!"}]
    greedy = lantern.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    both = llm.chat([MESSAGES, other], greedy)
    alone = llm.chat(other, greedy)
    assert both[1].outputs[0].text == alone[0].outputs[0].text


def test_token_filters_equal_the_servers(llm, srv):
    banned = dict(temperature=0, max_tokens=MAX_TOKENS, bad_words=["stairs", "the"])
    allowed = dict(SEEDED, max_tokens=6, allowed_token_ids=llm.encode(" blue green red", False))
    special = dict(temperature=0, max_tokens=2, allowed_token_ids=llm.encode("<|im_start|>", False),
                   skip_special_tokens=False)
    for fields in (banned, allowed, special):
        (out,) = llm.generate(PROMPTS[:1], lantern.SamplingParams(**fields))
        served = server_completions(srv, PROMPTS[0], **fields).choices[0]
        assert out.outputs[0].text == served.text, fields
    (out,) = llm.generate(PROMPTS[:1], lantern.SamplingParams(**special))
    assert out.outputs[0].text == "<|im_start|>" * 2
    (out,) = llm.generate(PROMPTS[:1], lantern.SamplingParams(**banned))
    one_token_words = [llm.encode(w, False) for w in ("the", " the")]
    assert all(len(w) == 1 for w in one_token_words)
    assert not {w[0] for w in one_token_words} & set(out.outputs[0].token_ids)
    (out,) = llm.generate(PROMPTS[:1], lantern.SamplingParams(**allowed))
    assert set(out.outputs[0].token_ids) <= set(allowed["allowed_token_ids"])


def test_llm_engine_gives_the_tokenizer_and_model_config_as_vllm(llm):
    engine = llm.llm_engine
    assert engine.get_tokenizer() is llm.get_tokenizer()
    # vLLM 0.x scripts: llm.llm_engine.tokenizer.tokenizer is the tokenizer.
    assert engine.tokenizer.tokenizer is llm.get_tokenizer()
    assert engine.tokenizer.get_lora_tokenizer(None) is llm.get_tokenizer()
    config = engine.get_model_config()
    assert config.max_model_len == llm.model_info["context_length"] > 0
    assert config.get_vocab_size() == llm.model_info["vocab_size"] == len(llm.get_tokenizer())
    assert config.model == llm.model_info["model"] == config.tokenizer
    with pytest.raises(lantern.InvalidRequestError, match="lora_request"):
        engine.get_tokenizer(lora_request=object())


def test_vllm_style_calls_work_as_in_vllm(llm):
    tok = llm.get_tokenizer()
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id in tok.stop_token_ids
    assert len(tok) == llm.model_info["vocab_size"]
    greedy = lantern.SamplingParams(temperature=0, max_tokens=2)
    (chat,) = llm.chat(MESSAGES, greedy)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True) == chat.prompt_token_ids
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == chat.prompt and text.endswith("<|im_start|>assistant\n")
    assert tok("hi there")["input_ids"] == tok.encode("hi there")
    assert tok.convert_ids_to_tokens(tok.encode(" sea", False)) == ["Ġsea"]
    # A chat template given with the call; numpy ids; vLLM's prompt types.
    (own,) = llm.chat(MESSAGES, greedy, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    assert own.prompt == MESSAGES[0]["content"]
    ids = tok.encode(PROMPTS[0])
    plain = llm.generate(ids, greedy)[0].outputs[0].text
    assert llm.generate(list(np.array(ids)), greedy)[0].outputs[0].text == plain
    from lantern.inputs import TokensPrompt
    assert llm.generate(TokensPrompt(prompt_token_ids=ids), greedy)[0].outputs[0].text == plain
    # A salted prompt shares no blocks with unsalted ones (vLLM's cache_salt).
    long_ids = tok.encode(" ".join(PROMPTS) * 6)
    llm.generate(long_ids, greedy)
    assert llm.generate(long_ids, greedy)[0].num_cached_tokens >= 32
    (salted,) = llm.generate(TokensPrompt(prompt_token_ids=long_ids, cache_salt="tenant"), greedy)
    assert salted.num_cached_tokens == 0
    # Every sampled token is ranked, in the top alternatives or not.
    (hot,) = llm.generate(PROMPTS[0], lantern.SamplingParams(temperature=1.5, seed=3, max_tokens=12, logprobs=1))
    for token, entry in zip(hot.outputs[0].token_ids, hot.outputs[0].logprobs):
        rank = entry[token].rank
        top = max(entry.values(), key=lambda lp: lp.logprob)
        assert rank >= 1 and (rank == 1) == (entry[token].logprob >= top.logprob)
    # vLLM's normal forms of SamplingParams.
    p = lantern.SamplingParams(seed=-1, logprobs=True, stop="x")
    assert (p.seed, p.logprobs, p.stop, p.stop_token_ids) == (None, 1, ["x"], [])
    # vLLM's outputs' fields for what does not run here, and a progress bar factory.
    (out,) = llm.generate(PROMPTS[:1], greedy, use_tqdm=False, lora_request=None)
    assert out.encoder_prompt is None and out.kv_transfer_params is None and out.outputs[0].lora_request is None
    bars = []

    class Bar:
        def __init__(self, **kwargs):
            bars.append(kwargs["total"])

        def update(self, n):
            pass

        def close(self):
            pass

    llm.generate(PROMPTS, greedy, use_tqdm=Bar)
    assert bars == [len(PROMPTS)]


def test_an_llm_seed_repeats_sampling_run_after_run():
    sampled = lantern.SamplingParams(temperature=1.0, max_tokens=8)
    runs = []
    for _ in range(2):
        with lantern.LLM(kv_cache_memory="64M", seed=11, trust_remote_code=True, dtype="auto") as llm:
            runs.append([o.outputs[0].text for o in llm.generate([PROMPTS[0]] * 2, sampled)])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]  # each request its own draw


def test_a_chat_template_may_be_given_as_text():
    # (A byte count as Python writes a large number, too.)
    with lantern.LLM(kv_cache_memory=6.4e7, chat_template="{% for m in messages %}<{{ m.content }}>{% endfor %}") as llm:
        (out,) = llm.chat(MESSAGES, lantern.SamplingParams(temperature=0, max_tokens=1))
        assert out.prompt == f"<{MESSAGES[0]['content']}>"


def test_token_prompts_and_logprobs_equal_the_servers(llm, srv):
    ids = llm.encode(PROMPTS[0])
    params = lantern.SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=1)
    (out,) = llm.generate([ids], params)
    assert out.prompt is None and out.prompt_token_ids == ids
    served = server_completions(srv, ids, max_tokens=4, temperature=0, logprobs=2).choices[0]
    assert out.outputs[0].text == served.text
    for step, theirs in zip(out.outputs[0].logprobs, served.logprobs.top_logprobs):
        top = {lp.decoded_token: lp.logprob for lp in step.values() if lp.rank is not None and lp.rank <= 2}
        assert top == pytest.approx(theirs, abs=1e-6)
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(served.logprobs.token_logprobs), abs=1e-5)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    # Token ids as a numpy array (one prompt, or a batch as rows) run as the list would.
    (arr,) = llm.generate(np.array(ids), lantern.SamplingParams(temperature=0, max_tokens=4))
    assert arr.prompt_token_ids == ids and arr.outputs[0].text == served.text
    rows = llm.generate(np.array([ids, ids]), lantern.SamplingParams(temperature=0, max_tokens=4))
    assert [r.outputs[0].text for r in rows] == [served.text] * 2
    for not_a_prompt in (b"bytes", None):
        with pytest.raises(lantern.InvalidRequestError):
            llm.generate(not_a_prompt)
    # vLLM's truncate_prompt_tokens: the prompt's end runs, as if sent alone.
    greedy = lantern.SamplingParams(temperature=0, max_tokens=4)
    (cut,) = llm.generate([ids], lantern.SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=3))
    (end,) = llm.generate([ids[-3:]], greedy)
    assert cut.prompt_token_ids == ids[-3:] and cut.outputs[0].text == end.outputs[0].text


CAPTURES = {
    "everything": {},
    "options": {"layers": "0,-1", "heads": "0:3", "rows": "prompt", "reduce": "mean_heads",
                "top_k": 4, "dtype": "float16"},
    "generated rows": {"layers": [7], "rows": "generated"},
    "key statistics": {"layers": "-3:", "stats": ["key_mass", "key_max", "block_mass"],
                       "stats_heads": "query"},
    "statistics and maps": {"layers": [2], "stats": "key_mass", "maps": True, "rows": "generated"},
    "spans": {"layers": "0,-1", "rows": "generated", "stats_heads": "mean",
              "spans": [{"label": "keeper", "chars": [4, 21]}, {"label": "stairs", "tokens": [5, 7]}]},
}


@pytest.mark.parametrize("case", CAPTURES)
def test_captures_equal_the_servers_bit_for_bit(llm, srv, case):
    options = CAPTURES[case]
    (out,) = llm.generate(PROMPTS[0], lantern.SamplingParams(temperature=0, max_tokens=5),
                          capture=options or True)
    fields = {f"attn_capture_{k}": v for k, v in options.items()}
    r = server_completions(srv, PROMPTS[0], max_tokens=5, temperature=0,
                           extra_body={"attn_capture": True, **fields})
    served = lantern_attn.from_response(r)
    att = out.attention
    assert out.outputs[0].text == r.choices[0].text
    assert att.meta == r.model_dump()["attn_capture_meta"]
    assert list(att.maps) == (att.meta["layers"] if att.meta.get("maps", True) else [])
    assert att.stats.keys() == served.stats.keys()
    for layer, theirs in served.stats.items():
        assert att.stats[layer].keys() == theirs.keys()
        for name, values in theirs.items():
            assert att.stats[layer][name].dtype == np.float32
            assert att.stats[layer][name].tobytes() == values.tobytes(), (layer, name)
    assert att.span_mass.keys() == served.span_mass.keys()
    for layer, theirs in served.span_mass.items():
        assert att.span_mass[layer].dtype == np.float32
        assert att.span_mass[layer].tobytes() == theirs.tobytes(), layer
    for layer, theirs in served.layers.items():
        ours = att.maps[layer]
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert ours.tobytes() == theirs.tobytes()
    assert att.indices.keys() == served.indices.keys()
    for layer, theirs in served.indices.items():
        assert att.indices[layer].dtype == np.int32
        assert np.array_equal(att.indices[layer], theirs)


def test_a_capture_reads_like_transformers_output_attentions(llm):
    (out,) = llm.generate(PROMPTS[0], lantern.SamplingParams(temperature=0, max_tokens=3),
                          capture={"layers": [0, 7]})
    att = out.attention
    total = len(out.prompt_token_ids) + len(out.outputs[0].token_ids)
    assert att.maps[7].shape == (total - 1, 9, total - 1)
    hf = att.to_hf()
    assert [a.shape for a in hf] == [(1, 9, total, total)] * 2
    assert len(att.tokens) == total
    assert list(att.row_positions) == list(range(total - 1))
    np.testing.assert_allclose(att.maps[0].sum(axis=-1), 1.0, atol=1e-5)


def test_streaming_gives_the_same_text_and_the_capture_last(llm):
    params = lantern.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    (whole,) = llm.generate(PROMPTS[0], params)
    updates = list(llm.stream(PROMPTS[0], params, capture={"layers": [0]}))
    assert len(updates) > 1
    assert "".join(u.deltas[0] for u in updates) == whole.outputs[0].text
    assert updates[-1].outputs[0].text == whole.outputs[0].text
    assert [u.finished for u in updates] == [False] * (len(updates) - 1) + [True]
    assert updates[-1].attention is not None and updates[0].attention is None
    chat = list(llm.stream_chat(MESSAGES, params))
    assert chat[-1].outputs[0].text == llm.chat(MESSAGES, params)[0].outputs[0].text


def test_streaming_sends_live_rows_equal_to_the_servers_and_the_final_capture(llm, srv):
    spans = [{"label": "keeper", "chars": [4, 21]}, {"label": "stairs", "tokens": [5, 7]}]
    capture = {"layers": [0, -1], "spans": spans, "stats_heads": "mean", "top_k": 2, "reduce": "mean_heads",
               "maps": True}
    params = lantern.SamplingParams(temperature=0, max_tokens=5)
    updates = list(llm.stream(PROMPTS[0], params, capture=capture))
    rows = [row for u in updates for row in u.attention_rows]
    final = updates[-1].attention
    prompt_len = final.prompt_len
    assert [r["position"] for r in rows] == list(range(prompt_len - 1, prompt_len + 4))
    positions = list(final.row_positions)
    for row in rows:
        for layer in row["layers"]:
            r = positions.index(row["position"])
            np.testing.assert_array_equal(np.array(layer["span_mass"], dtype=np.float32),
                                          final.span_mass[layer["layer_idx"]][r])
            assert layer["top_k"][0]["positions"] == final.indices[layer["layer_idx"]][r, 0].tolist()
    fields = {f"attn_capture_{k}": v for k, v in capture.items()}
    chunks = list(srv.client().completions.create(
        model=srv.model, prompt=PROMPTS[0], max_tokens=5, temperature=0, stream=True,
        extra_body={"attn_capture": True, **fields}))
    served = [c.model_dump()["attn_capture_row"] for c in chunks if c.model_dump().get("attn_capture_row")]

    def as_f32(value):  # JSON writes an f32 as f32 or as its f64 expansion: the same value
        if isinstance(value, float):
            return np.float32(value)
        if isinstance(value, list):
            return [as_f32(v) for v in value]
        if isinstance(value, dict):
            return {k: as_f32(v) for k, v in value.items()}
        return value

    assert as_f32(served) == as_f32(rows)
    # Not streamed, no live rows.
    (out,) = llm.generate(PROMPTS[0], params, capture=capture)
    assert out.attention_rows == []


def raises_naming(field, call):
    with pytest.raises(ValueError) as info:
        call()
    assert isinstance(info.value, lantern.InvalidRequestError)
    assert info.value.param == field, (info.value.param, str(info.value))
    assert field in str(info.value)
    return info.value


@pytest.mark.parametrize(
    "field, make",
    [
        ("temperature", lambda: lantern.SamplingParams(temperature=-1)),
        ("top_p", lambda: lantern.SamplingParams(top_p=0)),
        ("n", lambda: lantern.SamplingParams(n=0)),
        ("top_k", lambda: lantern.SamplingParams(top_k=-5)),
        ("min_tokens", lambda: lantern.SamplingParams(min_tokens=20, max_tokens=10)),
        ("stop", lambda: lantern.SamplingParams(stop=[1, 2])),
        ("presence_penalty", lambda: lantern.SamplingParams(presence_penalty=float("nan"))),
        ("logprobs", lambda: lantern.SamplingParams(logprobs=-1)),
        ("logit_bias", lambda: lantern.SamplingParams(logit_bias={5: float("inf")})),
        ("truncate_prompt_tokens", lambda: lantern.SamplingParams(truncate_prompt_tokens=0)),
        ("allowed_token_ids", lambda: lantern.SamplingParams(allowed_token_ids=[])),
        ("bad_words", lambda: lantern.SamplingParams(bad_words="no")),
        ("stop", lambda: lantern.SamplingParams(stop=[""])),
        ("detokenize", lambda: lantern.SamplingParams(detokenize=False)),
        ("structured_outputs", lambda: lantern.SamplingParams(structured_outputs={"xml": "a"})),
    ],
)
def test_bad_sampling_params_raise_naming_the_field(field, make):
    raises_naming(field, make)


def test_bad_requests_raise_naming_the_field(llm):
    greedy = lantern.SamplingParams(temperature=0, max_tokens=2)
    e = raises_naming('capture["layers"]', lambda: llm.generate("Hi", greedy, capture={"layers": [99]}))
    assert "99" in str(e)
    raises_naming('capture["rows"]', lambda: llm.generate("Hi", greedy, capture={"rows": "nonsense"}))
    raises_naming('capture["top_k"]', lambda: llm.generate("Hi", greedy, capture={"top_k": 0}))
    raises_naming('capture["stats"]', lambda: llm.generate("Hi", greedy, capture={"stats": ["nope"]}))
    raises_naming('capture["stats_heads"]',
                  lambda: llm.generate("Hi", greedy, capture={"stats": ["key_mass"], "stats_heads": "x"}))
    raises_naming('capture["spans"]', lambda: llm.generate("Hi", greedy, capture={"spans": []}))
    raises_naming('capture["maps"]', lambda: llm.generate("Hi", greedy, capture={"maps": 3}))
    raises_naming("capture", lambda: llm.generate("Hi", greedy, capture={"delivery": "file"}))
    e = raises_naming("capture", lambda: llm.generate("Hi", greedy, capture={"attn_capture_layers": 0}))
    assert 'use "layers"' in str(e), str(e)
    raises_naming("capture", lambda: llm.generate("Hi", lantern.SamplingParams(n=2), capture=True))
    e = raises_naming("capture", lambda: llm.generate("Hi", lantern.SamplingParams(max_tokens=8000),
                                                      capture=True))
    assert "max_capture_bytes" in str(e)
    raises_naming("max_tokens", lambda: llm.generate("Hi", lantern.SamplingParams(max_tokens=0)))
    raises_naming("prompt", lambda: llm.generate([[10**6]], greedy))
    raises_naming("messages", lambda: llm.chat([{"role": "wizard", "content": "x"}], greedy))
    raises_naming("logprobs", lambda: llm.chat(MESSAGES, lantern.SamplingParams(logprobs=50)))
    raises_naming("kv_cache_dtype", lambda: lantern.LLM(kv_cache_dtype="f8"))
    raises_naming("kv_cache_memory", lambda: lantern.LLM(kv_cache_memory="lots"))
    # More than any test machine has: refused before anything is allocated (it aborted
    # the interpreter).
    raises_naming("kv_cache_memory", lambda: lantern.LLM(kv_cache_memory="1000G"))
    raises_naming("threads", lambda: lantern.LLM(threads=-1))
    raises_naming("max_num_seqs", lambda: lantern.LLM(max_num_seqs=2.5))
    raises_naming("sampling_params", lambda: llm.generate("Hi", {"temperature": 0}))
    raises_naming("sampling_params", lambda: llm.generate(["Hi", "Yo"], [greedy, "greedy"]))
    raises_naming("device", lambda: lantern.LLM(device="gpu"))
    raises_naming("attention_backend", lambda: lantern.LLM(attention_backend="cuda"))
    raises_naming("gpu_memory_utilization", lambda: lantern.LLM(gpu_memory_utilization=1.5))
    raises_naming("tokenizer", lambda: lantern.LLM(tokenizer="HuggingFaceTB/SmolLM2-135M-Instruct"))
    raises_naming("dtype", lambda: lantern.LLM(dtype="int3"))
    raises_naming("structured_outputs", lambda: lantern.StructuredOutputsParams())
    raises_naming("best_of", lambda: lantern.SamplingParams(n=1, best_of=3))
    raises_naming("multi_modal_data", lambda: llm.generate({"prompt": "Hi", "multi_modal_data": {"image": 1}}))
    # A refused prompt of several names its place.
    e = raises_naming("prompt", lambda: llm.generate(["ok", [10**6]], greedy))
    assert str(e).startswith("prompt 1: "), str(e)
    raises_naming("no_such_option", lambda: lantern.LLM(no_such_option=1))
    raises_naming("kv_cache_memory", lambda: lantern.LLM(kv_cache_memory=2.5))
    raises_naming("kv_cache_memory", lambda: lantern.LLM(kv_cache_memory=[1]))
    raises_naming("seed", lambda: lantern.SamplingParams(seed=2**70))
    raises_naming("chat_template", lambda: lantern.LLM(chat_template="/no/such/template.jinja"))
    raises_naming("quantize", lambda: lantern.LLM(quantize="q8_0"))  # a GGUF file keeps its types
    raises_naming("chat_template", lambda: lantern.LLM(chat_template="{% for m %}"))
    raises_naming("tensor_parallel_size", lambda: lantern.LLM(tensor_parallel_size=2))
    raises_naming("prompt", lambda: llm.generate(["ok", None], greedy))
    raises_naming("prompt", lambda: llm.generate(5, greedy))
    raises_naming("token_ids", lambda: llm.decode([-1]))
    raises_naming("lora_request", lambda: llm.generate("Hi", greedy, lora_request=object()))
    raises_naming("chat_template", lambda: llm.chat(MESSAGES, greedy, chat_template="{% if %}"))
    nan = lantern.SamplingParams(max_tokens=2)
    nan.temperature = float("nan")
    raises_naming("temperature", lambda: llm.generate("Hi", nan))
    # Past the model's context: known once the model is read.
    e = raises_naming("max_model_len", lambda: lantern.LLM(max_model_len=10**7))
    assert "--" not in str(e) and "8192" in str(e)
    raises_naming("gpu_memory_utilization",
                  lambda: lantern.LLM(device="cuda", gpu_memory_utilization=1.5))
    with pytest.raises(TypeError):
        lantern.SamplingParams(no_such_field=1)
    # A refused prompt in a batch leaves nothing running.
    raises_naming("prompt", lambda: llm.generate(["Fine", [10**6]], greedy))
    assert_idle(llm)


def assert_idle(llm):
    stats = llm.stats()
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0, stats
    assert stats["kv_cache_free_blocks"] == stats["kv_cache_total_blocks"], stats


def test_ctrl_c_aborts_and_gives_back_every_block(llm):
    params = lantern.SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    seen = {}
    sent = []
    returned = threading.Event()

    def interrupt():
        # Once the batch holds blocks, as a user's Ctrl-C, and again each second while
        # generate runs, as a user would press it again: twice in a dozen full-suite
        # runs on 2 cores the first SIGINT went unseen (cause not found; never alone).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not returned.is_set():
            stats = llm.stats()
            if stats["kv_cache_free_blocks"] < stats["kv_cache_total_blocks"]:
                seen.update(stats)
                break
            time.sleep(0.02)
        while not returned.is_set() and not handled and len(sent) < 5:
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)
            returned.wait(1.0)

    def first_only(signum, frame):
        # Python's own handler raises at every SIGINT; a second one landing after
        # generate returned would stop the test session.
        handled.append(time.monotonic())
        if len(handled) == 1 and not returned.is_set():
            raise KeyboardInterrupt

    handled = []
    previous = signal.signal(signal.SIGINT, first_only)
    timer = threading.Thread(target=interrupt)
    started = time.monotonic()
    outputs = None
    try:
        timer.start()
        outputs = llm.generate(PROMPTS * 3, params, capture=None)
    except KeyboardInterrupt:
        pass
    finally:
        returned.set()
        timer.join()
        signal.signal(signal.SIGINT, previous)
    assert outputs is None, (
        f"generate returned after {time.monotonic() - started:.1f} s despite {len(sent)} "
        f"SIGINTs, {len(handled)} seen by the handler (stats when interrupting: {seen}): "
        f"{[(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs]}"
    )
    if len(sent) > 1:
        warnings.warn(f"generate stopped at SIGINT {len(sent)}, not the first (stats: {seen})")
    assert seen, "the batch never held a block"
    assert time.monotonic() - started < 60
    assert_idle(llm)
    # Leaving a stream early aborts its request too.
    streamed = lantern.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for update in llm.stream(PROMPTS[0], streamed, capture={"layers": [0]}):
        if len(update.outputs[0].token_ids) >= 3:
            break
    assert_idle(llm)
    # And the engine goes on serving.
    assert llm.generate("Hello", lantern.SamplingParams(max_tokens=2))[0].finished


def test_the_gil_is_released_while_the_engine_runs(llm):
    ticks = []
    done = threading.Event()

    def count():
        while not done.is_set():
            ticks.append(1)
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    started = time.monotonic()
    llm.generate(PROMPTS, lantern.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    elapsed = time.monotonic() - started
    done.set()
    counter.join()
    # A thread that sleeps 1 ms a tick gets hundreds of ticks a second when the GIL is free.
    assert len(ticks) > 50 * elapsed, (len(ticks), elapsed)


def test_a_gpu_asked_for_where_none_answers_is_a_clear_error():
    """device="cuda" on a machine without an NVIDIA driver (CI): the engine does not
    start, and the error says what was missing (where a GPU answers, it starts)."""
    try:
        llm = lantern.LLM(device="cuda", kv_cache_memory="64M")
    except lantern.EngineError as e:
        message = str(e)
        assert "cuda" in message, message
        assert "libcuda" in message or "without CUDA" in message, message
        return
    # A GPU answered: the engine runs there.
    (out,) = llm.generate("Hello", lantern.SamplingParams(max_tokens=4, temperature=0))
    assert len(out.outputs[0].token_ids) == 4


def test_a_missing_model_says_what_lantern_reads():
    """A model hub's id, as vLLM's `LLM("org/name")` takes one, is not fetched: the error
    names it and says what to give instead."""
    with pytest.raises(lantern.EngineError) as e:
        lantern.LLM("Qwen/Qwen2.5-0.5B-Instruct")
    message = str(e.value)
    assert "Qwen/Qwen2.5-0.5B-Instruct: no such file or directory" in message, message
    assert "does not download from a model hub" in message, message


def test_the_models_generation_config_gives_the_default_sampling_params(tmp_path):
    import shutil
    from pathlib import Path

    model = tmp_path / "hf"
    shutil.copytree(Path(__file__).resolve().parents[2] / "tests/fixtures/archs/llama/hf", model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(dict(config, temperature=0.9, top_k=1)))
    with lantern.LLM(model, kv_cache_memory="64M") as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k) == (0.9, 1)
        # Calls without parameters sample with them: top_k 1 is greedy.
        greedy = llm.generate("Hello there", lantern.SamplingParams(temperature=0))[0].outputs[0].text
        assert [llm.generate("Hello there")[0].outputs[0].text for _ in range(3)] == [greedy] * 3
    with lantern.LLM(model, kv_cache_memory="64M", generation_config="vllm") as llm:
        assert llm.get_default_sampling_params().top_k == 0


def test_a_capture_without_maps_says_so_when_its_maps_are_asked_for(llm):
    (out,) = llm.generate("Hello there", lantern.SamplingParams(temperature=0, max_tokens=2),
                          capture={"stats": ["key_mass"], "layers": [0]})
    assert out.attention.stats[0]["key_mass"].size > 0
    with pytest.raises(KeyError, match="no maps"):
        out.attention.to_hf()


def test_a_reasoning_parser_makes_structured_output_wait_for_thinking(llm):
    # vLLM's LLM(reasoning_parser=...): a DeepSeek-R1 output begins thinking (this
    # prompt ends with neither tag), so the grammar waits for `</think>`, which this
    # model never writes: the output is the unconstrained one. Text stays raw.
    params = lantern.SamplingParams(temperature=0, max_tokens=10, structured_outputs={"regex": r"Four\."})
    plain = llm.generate("Once upon a time", lantern.SamplingParams(temperature=0, max_tokens=10))[0]
    assert llm.generate("Once upon a time", params)[0].outputs[0].text == "Four."
    thinking = lantern.LLM(kv_cache_memory="64M", reasoning_parser="deepseek_r1")
    try:
        out = thinking.generate("Once upon a time", params)[0].outputs[0]
        assert out.text == plain.outputs[0].text
        # A prompt that closed its thinking is constrained from its first token.
        closed = thinking.generate("Once upon a time</think>\n", params)[0].outputs[0]
        assert closed.text == "Four."
    finally:
        thinking.close()
    with pytest.raises(lantern.InvalidRequestError, match="reasoning_parser"):
        lantern.LLM(kv_cache_memory="64M", reasoning_parser="granite")


def test_vllm_scripts_options_and_names_work():
    """What vLLM offline scripts pass and call: engine options that change nothing here,
    vLLM 0.10's guided_decoding, the tokenizer's Hugging Face methods, prompts from a
    generator, and sequences that stop at the context's end rather than fail."""
    with pytest.warns(UserWarning, match="dtype"):
        llm = lantern.LLM(
            kv_cache_memory="64M", max_model_len=64, dtype="bfloat16", gpu_memory_utilization=0.85,
            enable_chunked_prefill=True, max_logprobs=20, download_dir=None, enable_lora=False,
            tokenizer_mode="auto", quantization=None,
        )
    with llm:
        params = lantern.SamplingParams(
            max_tokens=8, guided_decoding=lantern.GuidedDecodingParams(choice=["yes", "no"]), best_of=1
        )
        (out,) = llm.generate("Is the sky blue? Answer:", params)
        assert out.outputs[0].text in ("yes", "no")
        tok = llm.get_tokenizer()
        assert tok("Hello world").input_ids == tok.encode("Hello world")
        eot = tok.convert_tokens_to_ids("<|im_end|>")
        assert eot in tok.all_special_ids and tok.decode(eot) == "<|im_end|>"
        assert tok.convert_tokens_to_ids(tok.tokenize(" the sea")) == tok.encode(" the sea", add_special_tokens=False)
        assert tok.batch_decode([[eot], tok.encode("Hi")]) == ["<|im_end|>", "Hi"]
        assert tok.get_vocab()["<|im_end|>"] == eot
        convs = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Yo"}]]
        assert tok.apply_chat_template(convs, tokenize=False) == [tok.apply_chat_template(c, tokenize=False) for c in convs]
        outs = llm.generate((p for p in ["One", "Two"]), lantern.SamplingParams(max_tokens=2, temperature=0))
        assert len(outs) == 2
        # A prompt of 60 tokens in a context of 64: 4 tokens, then `length`.
        (long,) = llm.generate([[tok.encode(" the")[0]] * 60], lantern.SamplingParams(max_tokens=16, ignore_eos=True))
        assert len(long.outputs[0].token_ids) == 4 and long.outputs[0].finish_reason == "length"
        assert llm.kv_cache_free_blocks == llm.kv_cache_total_blocks


def test_an_llm_samples_the_same_by_default_run_after_run():
    """vLLM V1's default seed is 0: an unseeded script samples the same in every run."""
    code = (
        "import lantern\n"
        "with lantern.LLM(kv_cache_memory='64M') as llm:\n"
        "    p = lantern.SamplingParams(temperature=1.0, max_tokens=6)\n"
        "    print([o.outputs[0].text for o in llm.generate(['Once upon a time', 'The sea'], p)])\n"
    )
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
            for _ in range(2)]
    assert runs[0] == runs[1] and runs[0].strip()
