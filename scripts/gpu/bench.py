#!/usr/bin/env python3
"""lantern against transformers on one GPU, side by side, in one run (~3-4 minutes on an
H200): the random bf16 models of scripts/gpu/make_models.py in SmolLM2-135M's and
Llama-3.2-1B's shapes.

    python3 scripts/gpu/bench.py --lantern BIN [--models DIR] [--json OUT.json]
        [--names smollm2-135m,llama-3.2-1b] [--budget 230]

lantern, first (so that nothing of transformers' holds the GPU meanwhile):
  lantern bench --device cuda --model DIR --json --prompt-tokens 512 --decode-tokens 64
      --batches 8,32,256 --repeat 2
  lantern bench --device cuda --model DIR --capture --capture-prompt-tokens 512 --repeat 1
      (text; its "512 tokens: X ms per layer" finalize line is read), then again with
      LANTERN_CUDA_KEEP_QUERIES=off (every capture's query rows copied to the host at each
      step instead of kept on the device: the "kept rows / host rows" rows); its batch of 8
      decoding with one capturing request against none capturing is the row "decode beside
      a capturing request / none capturing"
transformers (bf16, SDPA, its default dynamic cache, `generate` greedy with
min_new_tokens = max_new_tokens so that EOS cannot stop it), the same figures as lantern
defines them:
  prefill      a 512-token prompt, one forward and the first token, tokens/s
  decode b1    64 tokens after a 16-token prompt (lantern: after a 1-token prompt)
  decode b1@512  64 tokens after the 512-token prompt
  decode bN    aggregate tokens/s of N requests of 16-token prompts, 64 tokens each
               (lantern bench's batched figure: its prompts are 16 tokens)
               decode time = generate(65 tokens) - generate(1 token), over 64 x N tokens
  capture 512  one forward of a 512-token prompt with output_attentions=True (eager
               attention) and every layer's map copied to the host, ms; lantern: the
               request end to end, submitted to finalized maps (f32, every layer, head
               and prompt row; lantern bench --capture's "end to end" line)
The compiled static-cache path of transformers is left out (torch.compile takes 14 to 53 s
per shape); see docs/gpu.md for the figures measured once.

Prompts are random token ids (from 256 up, as lantern bench's), the same seed each run.
Output: a table of lantern / transformers ratios, and --json.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Budget:
    """--budget seconds, cut to scripts/test-gpu's step deadline ($TEST_GPU_STEP_DEADLINE)."""

    def __init__(self, seconds):
        step_end = float(os.environ.get("TEST_GPU_STEP_DEADLINE", "inf")) - 10
        self.end = min(time.time() + seconds, step_end)

    def left(self):
        return self.end - time.time()


def run(cmd, timeout, env=None):
    start = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout}s", time.time() - start
    if p.returncode != 0:
        return None, f"exit {p.returncode}: {p.stderr.strip()[-600:]}", time.time() - start
    return p.stdout, p.stderr, time.time() - start


def lantern_figures(args, model_dir, budget):
    base = [args.lantern, "bench"]
    if args.lantern_device:
        base += ["--device", args.lantern_device]
    base += ["--model", model_dir, "--kv-cache-memory", args.kv_cache_memory] + args.lantern_arg
    res = {}
    batches = [b for b in args.batches if b > 1]
    cmd = base + ["--json", "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens",
                  str(args.decode_tokens), "--batches", ",".join(map(str, batches)),
                  "--repeat", str(args.repeat)]
    # Leave transformers about 90 s of the budget.
    timeout = int(min(args.lantern_timeout, max(budget.left() - 90, 10)))
    out, err, secs = run(cmd, timeout)
    res["bench_cmd"] = " ".join(cmd)
    res["bench_seconds"] = round(secs, 1)
    if out is None:
        res["bench_error"] = err
    else:
        lines = [l for l in out.splitlines() if l.startswith("{")]
        try:
            res["bench"] = json.loads(lines[-1])
        except Exception as e:
            res["bench_error"] = f"unreadable output ({e}): {out[-400:]}"
    bench_cmd = cmd

    def variant(key, extra, env=None):
        """The same figures with `extra` arguments (and `env`), as res[key] (or key_error)."""
        timeout = int(min(args.lantern_timeout, max(budget.left() - 90, 10)))
        out, err, secs = run(bench_cmd + extra, timeout, env=env)
        lines = [l for l in (out or "").splitlines() if l.startswith("{")]
        try:
            res[key] = json.loads(lines[-1])
        except Exception:
            res[key + "_error"] = err or f"unreadable output: {(out or '')[-400:]}"
        return secs

    if args.lantern_eager:
        # Every step eager: what CUDA graphs give, in the same run.
        res["eager_seconds"] = round(variant("bench_eager", ["--enforce-eager"]), 1)
    if args.lantern_sampled:
        # Sampling at temperature 1 (rows sampled on the device from the draws of seeded
        # streams): what a client's default sampling costs against greedy.
        variant("bench_sampled", ["--temperature", "1"])
    if args.lantern_logprobs:
        # What evaluation and chat clients add: top-p, 5 top logprobs a token and a
        # repetition penalty (the rows edited, cut, sampled and scored on the device):
        # what they cost against greedy.
        variant("bench_logprobs", ["--temperature", "0.8", "--top-p", "0.95", "--logprobs", "5",
                                   "--repetition-penalty", "1.1"])
    if args.lantern_kernel_times:
        # Every step eager with each kernel timed (LANTERN_CUDA_PROFILE): where a step's
        # device time goes, against the graphed step's wall time above.
        variant("bench_kernel_times", ["--enforce-eager"], env={"LANTERN_CUDA_PROFILE": "on"})
    if args.lantern_unsplit_products:
        # One warp per column in every small product: what splitting the long columns of
        # products with few of them over more warps gives.
        variant("bench_unsplit", [], env={"LANTERN_CUDA_GEMV_SPLITS": "off"})
    if args.lantern_separate_norms:
        # Norms and residual adds launched apart at batch 1-4: what folding them into the
        # small products gives.
        variant("bench_separate_norms", [], env={"LANTERN_CUDA_FOLD_NORMS": "off"})
    if args.lantern_plain_launches:
        # Every kernel launched the plain way: what programmatic dependent launch gives.
        variant("bench_plain_launches", [], env={"LANTERN_CUDA_PDL": "off"})
    if args.lantern_quantized:
        # The same bf16 model quantized at load to GGUF types, which stay quantized on the
        # device: small products read them as stored, larger ones dequantize the rows
        # they take (against the bf16 weights, what keeping GGUF weights costs or gives).
        # Q4_1 reads as Q4_K does (4-bit quants, scales and mins) and fits rows of 576
        # (SmolLM2's; Q4_K needs multiples of 256); Q8_0 as the 8-bit types do.
        variant("bench_q4_1", ["--quantize", "q4_1"])
        variant("bench_q8_0", ["--quantize", "q8_0"])
        # What the dequantization of the rows past the small products costs a step: the
        # same Q4_1 weights dequantized to bf16 at load (none per step, more memory), and
        # kept but dequantized 16 MiB at a time (a chunk the L2 cache holds for the
        # product that reads it back) instead of 64.
        variant("bench_q4_1_at_load", ["--quantize", "q4_1"],
                env={"LANTERN_CUDA_QUANTIZED_WEIGHTS": "off"})
        variant("bench_q4_1_l2_chunks", ["--quantize", "q4_1"],
                env={"LANTERN_CUDA_DEQUANTIZED_CHUNK_MIB": "16"})
    if args.lantern_no_small_products:
        # cuBLAS for every product: what the small-product kernels give.
        variant("bench_cublas", [], env={"LANTERN_CUDA_SMALL_PRODUCTS": "off"})
    if args.no_capture:
        return res
    cmd = base + ["--capture", "--capture-prompt-tokens", str(args.capture_tokens), "--repeat", "1"]
    timeout = int(min(args.lantern_timeout, max(budget.left() - 90, 10)))
    out, err, secs = run(cmd, timeout)
    res["capture_cmd"] = " ".join(cmd)
    res["capture_seconds"] = round(secs, 1)
    if out is None:
        res["capture_error"] = err
        return res
    res["capture_text"] = out
    res.update(capture_figures(out, args.capture_tokens))
    # The same with every capture's query rows copied to the host at each step instead of
    # kept on the device (LANTERN_CUDA_KEEP_QUERIES=off), from the same binary.
    if budget.left() < 120:
        return res
    timeout = int(min(args.lantern_timeout, max(budget.left() - 90, 10)))
    out, err, secs = run(cmd, timeout, env={"LANTERN_CUDA_KEEP_QUERIES": "off"})
    if out is None:
        res["capture_host_rows_error"] = err
    else:
        res["capture_host_rows"] = capture_figures(out, args.capture_tokens)
    return res


def capture_figures(out, tokens):
    """The figures of `lantern bench --capture`'s text output."""
    res = {}
    m = re.search(r"^\s*(\d+) tokens:\s+([\d.]+) ms per layer", out, re.M)
    if m and int(m.group(1)) == tokens:
        res["capture_finalize_ms_per_layer"] = float(m.group(2))
    m = re.search(r"^\s*(\d+) tokens end to end:\s+([\d.]+) ms with capture,\s+([\d.]+) ms without", out, re.M)
    if m and int(m.group(1)) == tokens:
        res["capture_end_to_end_ms"] = float(m.group(2))
        res["capture_prompt_alone_ms"] = float(m.group(3))
    for key, label in (
        ("capture_decode_plain_tokens_per_s", r"no capturing request"),
        ("capture_decode_capturing_tokens_per_s", r"one capturing all \d+ layers"),
        ("stats_plain_tokens_per_s", r"key statistics: no capture"),
        ("stats_decode_tokens_per_s", r"key statistics, decode steps"),
    ):
        m = re.search(label + r"\s+([\d.]+) tokens/s", out)
        if m:
            res[key] = float(m.group(1))
    return res


def load_kwargs(dtype, attn):
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    return {key: dtype, "attn_implementation": attn}


def transformers_figures(args, model_dir, budget):
    import torch
    from transformers import AutoModelForCausalLM
    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    res = {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, **load_kwargs(torch.bfloat16, args.attn))
    model.to(device).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(7)

    def prompts(batch, length):
        return torch.randint(256, vocab, (batch, length), generator=gen).to(device)

    def timed(fn):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    def manual_greedy(ids, new):
        # What generate does here, without it: argmax of each step, the dynamic cache.
        past, nxt = None, ids
        for _ in range(new):
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = torch.argmax(out.logits[:, -1], dim=-1, keepdim=True)
        return nxt

    def generate(ids, new):
        if res.get("generate_fallback"):
            return manual_greedy(ids, new)
        try:
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  pad_token_id=model.config.pad_token_id or 0)
        except Exception as e:
            res["generate_fallback"] = f"generate failed ({e!r}); a plain greedy loop was timed"
            print(res["generate_fallback"], flush=True)
            return manual_greedy(ids, new)

    with torch.no_grad():
        # prefill: forward of the prompt and its first token, as lantern's figure.
        ids = prompts(1, args.prompt_tokens)
        def prefill():
            torch.argmax(model(input_ids=ids).logits[0, -1])
        prefill()
        t = statistics.median(timed(prefill) for _ in range(3))
        res["prefill_tokens_per_s"] = args.prompt_tokens / t

        def decode_rate(batch, length):
            ids = prompts(batch, length)
            generate(ids, 2)  # warm-up of this shape
            firsts, fulls = [], []
            for _ in range(args.repeat):
                firsts.append(timed(lambda: generate(ids, 1)))
                fulls.append(timed(lambda: generate(ids, args.decode_tokens + 1)))
            seconds = statistics.median(fulls) - statistics.median(firsts)
            return batch * args.decode_tokens / max(seconds, 1e-9)

        res["decode_tokens_per_s"] = {}
        for b in args.batches:
            if budget.left() < 20:
                res.setdefault("skipped", []).append(f"decode batch {b}: out of time")
                continue
            res["decode_tokens_per_s"][str(b)] = decode_rate(b, args.batch_prompt_tokens)
        if budget.left() > 20:
            res["decode_after_prompt_tokens_per_s"] = decode_rate(1, args.prompt_tokens)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()

    if args.no_capture or budget.left() < 20:
        return res
    # Attention maps: eager attention with output_attentions, every layer's map to the host.
    model = AutoModelForCausalLM.from_pretrained(model_dir, **load_kwargs(torch.bfloat16, "eager"))
    model.to(device).eval()
    ids = prompts(1, args.capture_tokens)
    with torch.no_grad():
        def capture():
            out = model(input_ids=ids, output_attentions=True)
            maps = [a.to("cpu") for a in out.attentions]
            return sum(m.numel() * m.element_size() for m in maps)
        nbytes = capture()
        res["capture_ms"] = 1e3 * statistics.median(timed(capture) for _ in range(3))
        res["capture_map_bytes"] = nbytes
        res["capture_map_dtype"] = "bfloat16"
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def ratio(a, b):
    return a / b if a and b else None


def table(name, layers, lan, hf, args):
    """Rows of (metric, transformers, lantern, lantern/transformers; >1: lantern better)."""
    rows = []
    bench = lan.get("bench") or {}
    batched = bench.get("batched_decode_tokens_per_s") or {}
    hf_dec = hf.get("decode_tokens_per_s") or {}

    def add(metric, h, l, higher_better=True, unit="tok/s"):
        r = ratio(l, h) if higher_better else ratio(h, l)
        rows.append({"model": name, "metric": metric, "unit": unit, "transformers": h,
                     "lantern": l, "speedup": r})

    add(f"prefill {args.prompt_tokens}", hf.get("prefill_tokens_per_s"), bench.get("prefill_tokens_per_s"))
    for b in args.batches:
        l = bench.get("decode_tokens_per_s") if b == 1 else batched.get(str(b))
        add(f"decode batch {b}", hf_dec.get(str(b)), l)
    add(f"decode b1 after {args.prompt_tokens}", hf.get("decode_after_prompt_tokens_per_s"),
        bench.get("decode_after_prompt_tokens_per_s"))
    per_layer = lan.get("capture_finalize_ms_per_layer")
    # Measured end to end (submission to finalized maps) where the bench prints it; else
    # the prefill rate's time plus finalize's (maps computed on the host at finalize).
    lan_capture = lan.get("capture_end_to_end_ms")
    if lan_capture is None and per_layer is not None and bench.get("prefill_tokens_per_s") and layers:
        lan_capture = 1e3 * args.capture_tokens / bench["prefill_tokens_per_s"] + per_layer * layers
    add(f"capture {args.capture_tokens} (prefill + maps)", hf.get("capture_ms"), lan_capture,
        higher_better=False, unit="ms")
    # What one capturing request costs the batch it decodes in (since 5aa23f4 such steps
    # replay graphs where the capture keeps its rows on the device).
    # And every request of a batch of 32 summing key statistics of every layer as its rows
    # run (since 1993931 their probabilities wait on the device for the step's end).
    for plain_key, key, metric in (
        ("capture_decode_plain_tokens_per_s", "capture_decode_capturing_tokens_per_s",
         "decode beside a capturing request / none capturing"),
        ("stats_plain_tokens_per_s", "stats_decode_tokens_per_s", "decode batch 32, key statistics / none"),
    ):
        plain, got = lan.get(plain_key), lan.get(key)
        if plain is not None and got is not None:
            rows.append({"model": name, "metric": metric, "unit": "tok/s", "transformers": plain,
                         "lantern": got, "speedup": ratio(got, plain)})
    host_rows = lan.get("capture_host_rows") or {}
    for key, metric, higher in (
        ("capture_decode_capturing_tokens_per_s", "decode beside a capturing request", True),
        ("capture_end_to_end_ms", f"capture {args.capture_tokens} end to end", False),
    ):
        kept, host = lan.get(key), host_rows.get(key)
        if kept is not None and host is not None:
            rows.append({"model": name, "metric": f"{metric}: kept rows / host rows",
                         "unit": "tok/s" if higher else "ms", "transformers": host,
                         "lantern": kept,
                         "speedup": ratio(kept, host) if higher else ratio(host, kept)})
    for key, label in (("bench_eager", "graphs / eager"), ("bench_cublas", "default / cuBLAS only"),
                       ("bench_plain_launches", "overlapped / plain launches"),
                       ("bench_separate_norms", "folded / separate norms"),
                       ("bench_unsplit", "split / unsplit products"),
                       ("bench_sampled", "greedy / temperature 1"),
                       ("bench_logprobs", "greedy / top-p, logprobs, penalty")):
        other = lan.get(key)
        if not other:
            continue
        other_batched = other.get("batched_decode_tokens_per_s") or {}
        for b in args.batches:
            e = other.get("decode_tokens_per_s") if b == 1 else other_batched.get(str(b))
            g = bench.get("decode_tokens_per_s") if b == 1 else batched.get(str(b))
            rows.append({"model": name, "metric": f"decode batch {b}: {label}", "unit": "tok/s",
                         "transformers": e, "lantern": g, "speedup": ratio(g, e)})
    # GGUF types kept quantized in the lantern column, the bf16 weights in the other.
    for key, label in (("bench_q4_1", "Q4_1 kept / bf16"), ("bench_q8_0", "Q8_0 kept / bf16")):
        other = lan.get(key)
        if not other:
            continue
        other_batched = other.get("batched_decode_tokens_per_s") or {}
        mib = lambda b: None if b is None else round(b / 2**20, 1)
        qw, bw = mib(other.get("device_weight_bytes")), mib(bench.get("device_weight_bytes"))
        rows.append({"model": name, "metric": f"weights on the device: {label}", "unit": "MiB",
                     "transformers": bw, "lantern": qw, "speedup": ratio(bw, qw)})
        q = other.get("prefill_tokens_per_s")
        rows.append({"model": name, "metric": f"prefill {args.prompt_tokens}: {label}", "unit": "tok/s",
                     "transformers": bench.get("prefill_tokens_per_s"), "lantern": q,
                     "speedup": ratio(q, bench.get("prefill_tokens_per_s"))})
        for b in args.batches:
            q = other.get("decode_tokens_per_s") if b == 1 else other_batched.get(str(b))
            g = bench.get("decode_tokens_per_s") if b == 1 else batched.get(str(b))
            rows.append({"model": name, "metric": f"decode batch {b}: {label}", "unit": "tok/s",
                         "transformers": g, "lantern": q, "speedup": ratio(q, g)})
    # One lantern variant over another.
    for top, bottom, label in (("bench_q4_1", "bench_q4_1_at_load", "Q4_1 kept / dequantized at load"),
                               ("bench_q4_1_l2_chunks", "bench_q4_1", "Q4_1 16 MiB / 64 MiB chunks")):
        a, b = lan.get(top), lan.get(bottom)
        if not a or not b:
            continue
        ab, bb = a.get("batched_decode_tokens_per_s") or {}, b.get("batched_decode_tokens_per_s") or {}
        for bs in args.batches:
            x = a.get("decode_tokens_per_s") if bs == 1 else ab.get(str(bs))
            y = b.get("decode_tokens_per_s") if bs == 1 else bb.get(str(bs))
            rows.append({"model": name, "metric": f"decode batch {bs}: {label}", "unit": "tok/s",
                         "transformers": y, "lantern": x, "speedup": ratio(x, y)})
    return rows


def fmt(v):
    if v is None:
        return "-"
    return f"{v:,.1f}" if v >= 10 else f"{v:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lantern", default=os.path.join(ROOT, "target", "release", "lantern"))
    ap.add_argument("--lantern-device", default="cuda", help="--device given to lantern (empty: none)")
    ap.add_argument("--lantern-arg", action="append", default=[], help="one more lantern bench argument")
    ap.add_argument("--lantern-timeout", type=int, default=90, help="seconds per lantern command")
    ap.add_argument("--kv-cache-memory", default="8G")
    ap.add_argument("--models", default="/tmp/lantern-test-gpu/models")
    ap.add_argument("--names", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--batches", default="1,8,32,256")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--batch-prompt-tokens", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--capture-tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--attn", default="sdpa", help="transformers' attention for the speed figures")
    ap.add_argument("--no-capture", action="store_true")
    ap.add_argument("--lantern-no-small-products", action="store_true",
                    help="also run lantern's bench with LANTERN_CUDA_SMALL_PRODUCTS=off (rows 'default / cuBLAS only')")
    ap.add_argument("--lantern-quantized", action="store_true",
                    help="also run lantern's bench with --quantize q4_1 and q8_0 (GGUF types kept quantized on the device; rows 'Q4_1 kept / bf16', 'Q8_0 kept / bf16'), and Q4_1 dequantized at load and in 16 MiB chunks (rows 'Q4_1 kept / dequantized at load', 'Q4_1 16 MiB / 64 MiB chunks')")
    ap.add_argument("--lantern-kernel-times", action="store_true",
                    help="also run lantern's bench eagerly with every kernel timed (LANTERN_CUDA_PROFILE=on): a table per model")
    ap.add_argument("--lantern-unsplit-products", action="store_true",
                    help="also run lantern's bench with LANTERN_CUDA_GEMV_SPLITS=off (rows 'split / unsplit products')")
    ap.add_argument("--lantern-separate-norms", action="store_true",
                    help="also run lantern's bench with LANTERN_CUDA_FOLD_NORMS=off (rows 'folded / separate norms')")
    ap.add_argument("--lantern-plain-launches", action="store_true",
                    help="also run lantern's bench with LANTERN_CUDA_PDL=off (rows 'overlapped / plain launches')")
    ap.add_argument("--lantern-eager", action="store_true",
                    help="also run lantern's bench with --enforce-eager (rows 'graphs / eager': the eager figure in the transformers column)")
    ap.add_argument("--lantern-sampled", action="store_true",
                    help="also run lantern's bench with --temperature 1 (rows 'greedy / temperature 1': the sampled figure in the transformers column)")
    ap.add_argument("--lantern-logprobs", action="store_true",
                    help="also run lantern's bench sampling at temperature 0.8, top-p 0.95, 5 logprobs, repetition penalty 1.1 (rows 'greedy / top-p, logprobs, penalty')")
    ap.add_argument("--skip-lantern", action="store_true")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--budget", type=float, default=230, help="seconds for the whole run")
    ap.add_argument("--device", default=None, help="transformers' device (default cuda if available)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b]
    budget = Budget(args.budget)

    names = [n for n in args.names.split(",") if n]
    dirs = {n: os.path.join(args.models, n) for n in names}
    missing = [n for n, d in dirs.items() if not os.path.isfile(os.path.join(d, "config.json"))]
    if missing:
        print(f"missing model directories {missing} under {args.models} (scripts/gpu/make_models.py)")
    names = [n for n in names if n not in missing]

    out = {"settings": {k: v for k, v in vars(args).items() if k not in ("json",)},
           "lantern": {}, "transformers": {}, "rows": [], "errors": [],
           "not_measured": "transformers' compiled static-cache path (torch.compile, 14-53 s of compiling per shape)"}
    # lantern first: nothing of transformers' on the GPU meanwhile.
    if not args.skip_lantern:
        for n in names:
            if budget.left() < 30:
                out["errors"].append(f"lantern {n}: out of time")
                continue
            r = lantern_figures(args, dirs[n], budget)
            out["lantern"][n] = r
            for key in ("bench_error", "capture_error"):
                if key in r:
                    out["errors"].append(f"lantern {n} {key}: {r[key][:300]}")
            print(f"lantern {n}: bench {r.get('bench_seconds')}s, capture {r.get('capture_seconds')}s", flush=True)
    if not args.skip_transformers:
        import torch
        import transformers
        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        out["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
        for n in names:
            if budget.left() < 30:
                out["errors"].append(f"transformers {n}: out of time")
                continue
            start = time.time()
            try:
                out["transformers"][n] = transformers_figures(args, dirs[n], budget)
            except Exception as e:
                out["errors"].append(f"transformers {n}: {e!r}")
                out["transformers"][n] = {"error": repr(e)}
            print(f"transformers {n}: {time.time() - start:.1f}s", flush=True)

    for n in names:
        with open(os.path.join(dirs[n], "config.json")) as f:
            layers = json.load(f)["num_hidden_layers"]
        out["rows"] += table(n, layers, out["lantern"].get(n, {}), out["transformers"].get(n, {}), args)
    lines = [f"{'model':<14} {'figure':<30} {'transformers':>13} {'lantern':>11} {'lantern/HF':>10}"]
    for r in out["rows"]:
        unit = r["unit"]
        lines.append(f"{r['model']:<14} {r['metric'] + ' (' + unit + ')':<30} {fmt(r['transformers']):>13} "
                     f"{fmt(r['lantern']):>11} {fmt(r['speedup']) + 'x' if r['speedup'] else '-':>10}")
    out["table"] = lines
    out["seconds"] = round(args.budget - budget.left(), 1)
    print("\n".join(lines))
    print("lantern/HF: how many times faster lantern is (capture: HF ms / lantern ms)")
    for n in names:
        times = (out["lantern"].get(n, {}).get("bench_kernel_times") or {}).get("kernel_times")
        if times:
            total = sum(t["seconds"] for t in times) or 1.0
            print(f"{n}: device time per kernel, every step eager (LANTERN_CUDA_PROFILE=on)")
            for t in times[:16]:
                print(f"  {t['kernel']:<28} {t['launches']:>9} launches {t['seconds'] * 1e3:>10.2f} ms "
                      f"{t['seconds'] * 1e6 / max(t['launches'], 1):>8.2f} us each {100 * t['seconds'] / total:>5.1f}%")
    for e in out["errors"]:
        print("error:", e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    sys.exit(1 if out["errors"] else 0)


if __name__ == "__main__":
    main()
