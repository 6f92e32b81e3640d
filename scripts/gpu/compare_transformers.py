#!/usr/bin/env python3
"""lantern against transformers: greedy tokens from the same prompt ids, per model.

    python3 scripts/gpu/compare_transformers.py --lantern BIN [--models DIR]
        [--archs tests/fixtures/archs] [--json OUT.json] [--max-tokens 16]
        [--lantern-device cuda] [--only NAME,...]

Models: every directory of --models holding a config.json (scripts/gpu/make_models.py's
random bf16 models in real shapes) and every tests/fixtures/archs/<arch>/hf (the tiny
random models of each architecture).

For each: lantern generates greedily (`lantern generate --device cuda --model DIR --prompt
TEXT --max-tokens 16 --temperature 0 --ignore-eos --json`; the tiny archs with
`--kv-cache-dtype f32`); transformers then runs its own greedy loop (argmax of each step's
logits, its default dynamic KV cache, EOS not treated specially, as --ignore-eos) from
lantern's `prompt_token_ids`, so both see the same ids and only the model's arithmetic is
compared. transformers runs in bf16 and in f32 on the GPU (SDPA for the made models;
eager for the tiny archs, whose Gemma 2 soft-caps need it).

Per reference: the first position where the greedy tokens differ, and there
transformers' own top-2 margin and how far lantern's token is below transformers' choice
in transformers' logits (the gap) and its rank. Random bf16 models have near-ties: a
divergence whose gap is within the reference's tolerance (bf16: 0.125 + 2% of the top
logit; f32: 0.01 + 0.1%) and whose token is transformers' second or third choice is
called a near-tie; a larger gap a mismatch (a bug until shown otherwise).

Verdicts: match (all tokens equal under some reference), near-tie, mismatch, error
(lantern or transformers failed), skipped (scripts/test-gpu's step deadline,
$TEST_GPU_STEP_DEADLINE, was near). Exit status 1 on any mismatch, error or skip. The JSON
is rewritten after each model.
"""
import argparse
import json
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PROMPT = ("The quick brown fox jumps over the lazy dog. Once upon a time, in a "
                  "small village by the sea, there lived an old fisherman who")
TOLERANCE = {"bf16": (0.125, 0.02), "f32": (0.01, 0.001)}


def find_models(models_dir, archs_dir, only, made_attn):
    cases = []
    if archs_dir and os.path.isdir(archs_dir):
        for arch in sorted(os.listdir(archs_dir)):
            d = os.path.join(archs_dir, arch, "hf")
            if os.path.isfile(os.path.join(d, "config.json")):
                cases.append({"name": f"archs/{arch}", "kind": "arch", "dir": d, "attn": "eager",
                              "lantern_args": ["--kv-cache-dtype", "f32"]})
    if models_dir and os.path.isdir(models_dir):
        for name in sorted(os.listdir(models_dir)):
            d = os.path.join(models_dir, name)
            if os.path.isfile(os.path.join(d, "config.json")):
                cases.append({"name": name, "kind": "made", "dir": d, "attn": made_attn,
                              "lantern_args": []})
    if only:
        keep = set(only.split(","))
        cases = [c for c in cases if c["name"] in keep or c["name"].split("/")[-1] in keep]
    return cases


def deadline():
    """scripts/test-gpu's end of this step (epoch seconds), if it set one."""
    return float(os.environ.get("TEST_GPU_STEP_DEADLINE", "inf"))


def run_lantern(args, case):
    cmd = [args.lantern, "generate"]
    if args.lantern_device:
        cmd += ["--device", args.lantern_device]
    cmd += ["--model", case["dir"], "--prompt", args.prompt, "--max-tokens", str(args.max_tokens),
            "--temperature", "0", "--ignore-eos", "--json", "--kv-cache-memory", "1G"]
    cmd += case["lantern_args"] + args.lantern_arg
    start = time.time()
    result = {"cmd": " ".join(cmd)}
    timeout = max(5, min(args.lantern_timeout, deadline() - start - 20))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        result.update(ok=False, error=f"timed out after {timeout:.0f}s", timed_out=True,
                      stderr_tail=(e.stderr or b"")[-2000:].decode("utf-8", "replace")
                      if isinstance(e.stderr, bytes) else (e.stderr or "")[-2000:])
        return result
    result["seconds"] = round(time.time() - start, 2)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
        result.update(ok=False, error=f"exit {p.returncode}", stderr_tail=p.stderr[-2000:],
                      stdout_tail=p.stdout[-500:])
        return result
    out = json.loads(lines[-1])
    result.update(ok=True, prompt_token_ids=out["prompt_token_ids"], token_ids=out["token_ids"],
                  text=out.get("text"), timings=out.get("timings"))
    if p.stderr.strip():
        result["stderr_tail"] = p.stderr[-1000:]
    return result


def python_prompt_ids(case, prompt):
    """The prompt's ids from tokenizer.json, for a transformers run when lantern gave none."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(case["dir"], "tokenizer.json"))
    return tok.encode(prompt, add_special_tokens=False).ids


def load_kwargs(dtype, attn):
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    return {key: dtype, "attn_implementation": attn}


def hf_greedy(case, dtype_name, prompt_ids, steps, device):
    """transformers' greedy tokens and each step's logits' top-3 (ids, values) and the
    logits themselves at every step (kept on the host, for the divergence analysis)."""
    import torch
    from transformers import AutoModelForCausalLM
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype_name]
    model = AutoModelForCausalLM.from_pretrained(case["dir"], **load_kwargs(dtype, case["attn"]))
    model.to(device).eval()
    ids = torch.tensor([prompt_ids], device=device)
    tokens, logits_steps = [], []
    past = None
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            nxt = int(torch.argmax(logits))
            tokens.append(nxt)
            logits_steps.append(logits.cpu())
            ids = torch.tensor([[nxt]], device=device)
    del model, past
    if device == "cuda":
        torch.cuda.empty_cache()
    return tokens, logits_steps


def analyse(ref_name, hf_tokens, logits_steps, lantern_tokens):
    import torch
    abs_tol, rel_tol = TOLERANCE[ref_name]
    margins = []
    for lg in logits_steps:
        top = torch.topk(lg, 2).values
        margins.append(round(float(top[0] - top[1]), 4))
    r = {"tokens": hf_tokens, "top2_margins": margins}
    n = min(len(hf_tokens), len(lantern_tokens))
    d = next((i for i in range(n) if hf_tokens[i] != lantern_tokens[i]), None)
    if d is None and len(lantern_tokens) >= len(hf_tokens):
        r.update(first_divergence=None, verdict="match")
        return r
    if d is None:
        r.update(first_divergence=n, verdict="mismatch", why="lantern gave fewer tokens")
        return r
    lg = logits_steps[d]
    hf_tok, lt_tok = hf_tokens[d], lantern_tokens[d]
    if lt_tok >= lg.numel():
        r.update(first_divergence=d, verdict="mismatch", why=f"lantern's token {lt_tok} is past the vocabulary")
        return r
    top = float(lg[hf_tok])
    gap = top - float(lg[lt_tok])
    rank = int((lg > lg[lt_tok]).sum())  # 0 would be transformers' own choice
    tol = abs_tol + rel_tol * abs(top)
    near = gap <= tol and rank <= 2
    r.update(first_divergence=d, hf_token=hf_tok, lantern_token=lt_tok,
             margin_top2=round(float(torch.topk(lg, 2).values[0] - torch.topk(lg, 2).values[1]), 4),
             gap=round(gap, 4), lantern_token_rank=rank, tolerance=round(tol, 4),
             verdict="near-tie" if near else "mismatch")
    return r


def write(path, summary):
    if path:
        with open(path + ".part", "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(path + ".part", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lantern", default=os.path.join(ROOT, "target", "release", "lantern"))
    ap.add_argument("--lantern-device", default="cuda",
                    help="--device given to lantern (empty: none, lantern's CPU)")
    ap.add_argument("--lantern-arg", action="append", default=[],
                    help="one more argument for lantern generate (repeatable)")
    ap.add_argument("--lantern-timeout", type=int, default=90)
    ap.add_argument("--models", default="/tmp/lantern-test-gpu/models")
    ap.add_argument("--archs", default=os.path.join(ROOT, "tests", "fixtures", "archs"))
    ap.add_argument("--only", default="", help="comma-separated model names")
    ap.add_argument("--made-attn", default="sdpa", help="transformers' attention for the made models")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--refs", default="bf16,f32", help="transformers dtypes to compare with")
    ap.add_argument("--device", default=None, help="transformers' device (default cuda if available)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    import torch
    import transformers
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cases = find_models(args.models, args.archs, args.only, args.made_attn)
    if not cases:
        sys.exit("no models found")
    summary = {"prompt": args.prompt, "max_tokens": args.max_tokens, "device": device,
               "lantern_device": args.lantern_device, "transformers": transformers.__version__,
               "torch": torch.__version__, "results": []}
    timeouts = 0
    for case in cases:
        start = time.time()
        res = {"name": case["name"], "kind": case["kind"], "dir": case["dir"]}
        if deadline() - start < 25:
            res.update(verdict="skipped", detail="out of time")
            summary["results"].append(res)
            print(f"{case['name']:<34} skipped   out of time", flush=True)
            continue
        if timeouts >= 2:
            lan = {"ok": False, "error": "not run: lantern timed out twice already"}
        else:
            lan = run_lantern(args, case)
            timeouts += bool(lan.get("timed_out"))
        res["lantern"] = lan
        prompt_ids = lan.get("prompt_token_ids")
        if prompt_ids is None:
            try:
                prompt_ids = python_prompt_ids(case, args.prompt)
                res["prompt_ids_from"] = "tokenizers (lantern failed)"
            except Exception as e:
                res["prompt_ids_error"] = repr(e)
        res["references"] = {}
        for ref in [r for r in args.refs.split(",") if r]:
            if prompt_ids is None:
                break
            try:
                tokens, logits = hf_greedy(case, ref, prompt_ids, args.max_tokens, device)
                if lan.get("ok"):
                    res["references"][ref] = analyse(ref, tokens, logits, lan["token_ids"])
                else:
                    res["references"][ref] = {"tokens": tokens, "verdict": None}
            except Exception as e:
                res["references"][ref] = {"error": repr(e), "traceback": traceback.format_exc()[-1500:]}
        verdicts = [r.get("verdict") for r in res["references"].values()]
        if not lan.get("ok"):
            res["verdict"] = "error"
            res["detail"] = f"lantern: {lan.get('error')}: {(lan.get('stderr_tail') or '').strip()[-160:]}"
        elif not any(v for v in verdicts):
            res["verdict"] = "error"
            res["detail"] = "transformers failed: " + "; ".join(
                r.get("error", "")[:120] for r in res["references"].values())
        else:
            order = ["match", "near-tie", "mismatch"]
            best = min((v for v in verdicts if v), key=order.index)
            res["verdict"] = best
            parts = []
            for ref, r in res["references"].items():
                if r.get("verdict") == "match":
                    parts.append(f"{ref}: all {args.max_tokens} equal")
                elif r.get("verdict"):
                    parts.append(f"{ref}: diverge at {r.get('first_divergence')} gap {r.get('gap')} "
                                 f"rank {r.get('lantern_token_rank')} margin {r.get('margin_top2')}")
                else:
                    parts.append(f"{ref}: {r.get('error', 'n/a')[:60]}")
            res["detail"] = "; ".join(parts)
        res["seconds"] = round(time.time() - start, 1)
        summary["results"].append(res)
        print(f"{case['name']:<34} {res['verdict']:<9} {res['detail']}  ({res['seconds']}s)", flush=True)
        write(args.json, summary)  # after each model: a step killed at its timeout keeps them
    summary["passed"] = all(r["verdict"] in ("match", "near-tie") for r in summary["results"])
    summary["complete"] = True
    write(args.json, summary)
    counts = {}
    for r in summary["results"]:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    print("compare:", ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    sys.exit(0 if summary["passed"] else 1)


if __name__ == "__main__":
    main()
