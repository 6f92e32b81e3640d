#!/usr/bin/env python3
"""Random-weight bf16 Hugging Face model directories in the shapes of real models, made
without any hub access, for the GPU comparisons and benchmarks (scripts/test-gpu).

    python3 scripts/gpu/make_models.py --out DIR [--models smollm2-135m,llama-3.2-1b]
                                       [--layers N] [--device cuda|cpu] [--seed S]

Each DIR/<name>/ holds what lantern and transformers read from a released checkpoint:
config.json (written by hand the way released checkpoints write it: top-level rope_theta
and rope_scaling, as lantern's HF loader reads them), generation_config.json,
model.safetensors (bf16; a tied lm_head is left out, as released), tokenizer.json and
tokenizer_config.json.

The tokenizer is the byte-level BPE tokenizer of the tiny fixtures
(tests/fixtures/archs/llama/hf, SmolLM2's first 2048 ids) with placeholder tokens
`<|tN|>` appended up to the model's vocab_size: lantern refuses to decode an id past the
tokenizer's vocabulary, so the two must be the same size. The placeholders are never
produced by encoding text (no merge leads to them) but decode to their own text.

Weights: normal(0, c / sqrt(fan_in)) for every matrix (c = --init-scale, 1.0), embeddings
normal(0, 1 / sqrt(hidden)), RMSNorm weights 1 (Gemma's stored offsets 0): activations
stay of order one through the layers. Made on the GPU when there is one (seconds for the
1B shape); --layers cuts the layer count (a quick check on a CPU).

A directory whose recipe (shape, seed, scale, layers) is unchanged is kept as it is.
"""
import argparse
import contextlib
import copy
import json
import math
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE_TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "archs", "llama", "hf")

# Special ids of the fixture tokenizer: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2.
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}

LLAMA_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    **SPECIAL,
}

SHAPES = {
    # HuggingFaceTB/SmolLM2-135M's shape.
    "smollm2-135m": {
        **LLAMA_COMMON,
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
    },
    # meta-llama/Llama-3.2-1B's shape, with its Llama 3 RoPE scaling.
    "llama-3.2-1b": {
        **LLAMA_COMMON,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
    },
    # google/gemma-3-270m's shape (text): 5 sliding-window layers to 1 global, QK-norm.
    "gemma3-270m": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        **SPECIAL,
    },
}
DEFAULT_MODELS = "smollm2-135m,llama-3.2-1b"


def config_for(name, layers):
    cfg = copy.deepcopy(SHAPES[name])
    if layers:
        cfg["num_hidden_layers"] = min(layers, cfg["num_hidden_layers"])
    if cfg["model_type"] == "gemma3_text":
        n, p = cfg["num_hidden_layers"], cfg["sliding_window_pattern"]
        cfg["layer_types"] = ["full_attention" if (i + 1) % p == 0 else "sliding_attention"
                              for i in range(n)]
    return cfg


def write_tokenizer(out_dir, vocab_size):
    """The fixture's tokenizer with placeholders appended up to `vocab_size` ids."""
    with open(os.path.join(FIXTURE_TOKENIZER, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    vocab = tj["model"]["vocab"]
    have = max(vocab.values()) + 1
    if have != len(vocab):
        raise SystemExit(f"{FIXTURE_TOKENIZER}: vocabulary ids are not 0..{len(vocab) - 1}")
    if vocab_size < have:
        raise SystemExit(f"vocab_size {vocab_size} is below the tokenizer's {have}")
    for i in range(have, vocab_size):
        token = f"<|t{i}|>"
        assert token not in vocab, token
        vocab[token] = i
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    with open(os.path.join(FIXTURE_TOKENIZER, "tokenizer_config.json"), encoding="utf-8") as f:
        tc = json.load(f)
    tc["vocab_size"] = vocab_size
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tc, f, ensure_ascii=False, indent=2)


def from_config_kwargs(dtype):
    """transformers >= 4.56 takes `dtype`, older ones `torch_dtype`."""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def init_weights(model, cfg, seed, scale, device):
    import torch
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    hidden = cfg["hidden_size"]
    gemma = cfg["model_type"].startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.0 if gemma else 1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif "embed_tokens" in name or "lm_head" in name:
                std = 1.0 / math.sqrt(hidden)
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * std)
            else:
                std = scale / math.sqrt(p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * std)


def make(name, out_dir, layers, seed, scale, device):
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = config_for(name, layers)
    recipe = {"name": name, "seed": seed, "init_scale": scale, "layers": cfg["num_hidden_layers"],
              "config": cfg, "tokenizer": "tests/fixtures/archs/llama/hf + <|tN|> placeholders"}
    stamp = os.path.join(out_dir, "recipe.json")
    if os.path.exists(stamp) and os.path.exists(os.path.join(out_dir, "model.safetensors")):
        with open(stamp) as f:
            if json.load(f) == recipe:
                print(f"{name}: kept {out_dir}")
                return
    start = time.time()
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    gcfg = {**SPECIAL, "do_sample": False}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gcfg, f, indent=2)
    write_tokenizer(out_dir, cfg["vocab_size"])

    hcfg = AutoConfig.from_pretrained(out_dir)
    # torch.device as a context (torch >= 2) builds the parameters on the GPU directly.
    where = torch.device(device) if device != "cpu" else contextlib.nullcontext()
    with where:
        model = AutoModelForCausalLM.from_config(hcfg, **from_config_kwargs(torch.float32))
    init_weights(model, cfg, seed, scale, device)
    sd = model.state_dict()
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    sd = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in sd.items()}
    params = sum(v.numel() for v in sd.values())
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    del model, sd
    if device == "cuda":
        torch.cuda.empty_cache()
    with open(stamp, "w") as f:
        json.dump(recipe, f, indent=2)
    print(f"{name}: {params / 1e6:.1f}M parameters, {cfg['num_hidden_layers']} layers, "
          f"vocab {cfg['vocab_size']} -> {out_dir} ({time.time() - start:.1f}s)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory of the model directories")
    ap.add_argument("--models", default=DEFAULT_MODELS,
                    help=f"comma-separated, of {', '.join(SHAPES)} (default {DEFAULT_MODELS})")
    ap.add_argument("--layers", type=int, default=0, help="at most this many layers (0: the real count)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--init-scale", type=float, default=1.0)
    ap.add_argument("--device", default=None, help="where to make the weights (default cuda if available)")
    args = ap.parse_args()

    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        sys.exit(f"unknown model shapes {unknown}; known: {list(SHAPES)}")
    os.makedirs(args.out, exist_ok=True)
    for i, name in enumerate(names):
        make(name, os.path.join(args.out, name), args.layers, args.seed + i, args.init_scale, device)


if __name__ == "__main__":
    main()
