"""The architectures interpretability work starts from — GPT-2, Pythia (GPT-NeoX), OLMo 2
and OLMo 3 — SmolLM3 (layers without RoPE) and gpt-oss (attention sinks) through a real `lantern serve` and the
official openai client: the tiny
checkpoints of tests/fixtures/archs (Hugging Face directories as transformers saves them)
continue their reference prompts with transformers' greedy tokens, and the attention maps
a client captures over the wire are transformers' own."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "python"))
import lantern_attn  # noqa: E402

ARCHS = ROOT / "tests/fixtures/archs"


def reference(arch):
    summary = json.loads((ARCHS / arch / "ref/summary.json").read_text())
    for p in summary["prompts"]:
        yield p, np.load(ARCHS / arch / "ref" / f"{p['id']}.npz")


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "olmo2", "olmo3", "smollm3", "gemma", "granite", "phi", "cohere", "cohere2", "glm4", "olmo", "opt", "starcoder2", "gpt_oss"])
def test_greedy_tokens_and_captured_maps_equal_transformers(arch):
    srv = start_server(
        "--model", f"tests/fixtures/archs/{arch}/hf",
        "--kv-cache-dtype", "f32",
        "--enable-attention-capture",
    )
    try:
        client = srv.client()
        for prompt, npz in reference(arch):
            r = client.completions.create(
                model=srv.model,
                prompt=prompt["prompt_ids"],
                max_tokens=len(prompt["gen_ids"]),
                temperature=0,
                logprobs=0,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            )
            got = [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]
            assert got == prompt["gen_ids"], (arch, prompt["id"])

            # Every layer's map of the prompt's rows, as transformers' eager attention.
            r = client.completions.create(
                model=srv.model,
                prompt=prompt["prompt_ids"],
                max_tokens=1,
                temperature=0,
                extra_body={"attn_capture": True, "ignore_eos": True},
            )
            cap = lantern_attn.from_response(r)
            n = len(prompt["prompt_ids"])
            assert sorted(cap.layers) == [int(l) for l in npz["layers"]]
            keys = np.asarray(cap.key_positions)
            compared = 0
            for layer in cap.layers:
                dense = cap.dense(layer)
                ref = npz[f"attn_L{layer}"]
                for row, pos in enumerate(cap.row_positions):
                    if pos >= n:
                        continue
                    np.testing.assert_allclose(
                        dense[row][:, keys < n], ref[pos, :, :n], atol=1e-4,
                        err_msg=f"{arch} {prompt['id']} layer {layer} row {pos}")
                    compared += 1
            # Every prompt row of every layer was there to compare.
            assert compared == n * len(cap.layers), (arch, prompt["id"], compared)
    finally:
        stop_server(srv)
