"""Mixture-of-experts models through a real `lantern serve` and the official openai client:
the tiny Mixtral and Qwen3-MoE checkpoints of tests/fixtures/archs (Hugging Face
directories, experts one tensor each) continue their reference prompts with transformers'
greedy tokens, and an attention capture of them is well formed."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "python"))
import lantern_attn  # noqa: E402


def reference(arch):
    summary = json.loads((ROOT / "tests/fixtures/archs" / arch / "ref/summary.json").read_text())
    return {p["id"]: p for p in summary["prompts"]}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_greedy_tokens_equal_transformers_and_captures_are_whole(arch):
    srv = start_server(
        "--model", f"tests/fixtures/archs/{arch}/hf",
        "--kv-cache-dtype", "f32",
        "--enable-attention-capture",
    )
    try:
        client = srv.client()
        for prompt in reference(arch).values():
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
        r = client.completions.create(
            model=srv.model,
            prompt="The tide comes in",
            max_tokens=4,
            temperature=0,
            extra_body={"attn_capture": True, "ignore_eos": True},
        )
        cap = lantern_attn.from_response(r)
        layers = json.loads((ROOT / "tests/fixtures/archs" / arch / "hf/config.json").read_text())[
            "num_hidden_layers"]
        assert sorted(cap.layers) == list(range(layers))
        keys = np.asarray(cap.key_positions)
        for layer in cap.layers:
            dense = cap.dense(layer)
            for row, pos in enumerate(cap.row_positions):
                assert np.all(dense[row][:, keys > pos] == 0)
                np.testing.assert_allclose(dense[row].sum(axis=-1), 1.0, atol=1e-5)
    finally:
        stop_server(srv)
