"""What scripts/compare-llamacpp and scripts/bench-scaling share: building lantern and
llama.cpp's tools, running `lantern bench` and `llama-bench` / `llama-batched-bench` on one
model and thread count, and reading their figures into the same keys (tokens/s):

    prefill_tokens_per_s               512-token prompt (llama-bench pp512)
    decode_tokens_per_s                batch 1 from an empty context (tg128)
    decode_after_prompt_tokens_per_s   batch 1 after 512 tokens (-p 0 -n 128 -d 512)
    batched_decode_tokens_per_s        {"8": .., "32": ..}: aggregate (llama-batched-bench S_TG)

and the table of lantern's own speedups paired within one process (`--thread-speedup`).
Not a script: the scripts import it from this folder (scripts/device-cpu-bench too).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd, **kw):
    print("+", " ".join(str(c) for c in cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def cache_dir():
    """lantern's cache directory, as lantern and scripts/build-llamacpp find it."""
    return Path(os.environ.get("LANTERN_CACHE_DIR") or
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lantern")


def build_lantern(workspace=True):
    """Builds lantern (release) and returns its binary."""
    what = ["--workspace"] if workspace else ["-p", "lantern-cli"]
    run(["cargo", "build", "--release", "-q", *what], cwd=ROOT)
    target = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    if not target.is_absolute():
        target = ROOT / target
    return target / "release" / "lantern"


def llamacpp_bindir(build):
    """llama.cpp's binaries built by scripts/build-llamacpp (`native`, `avx2` or `avx512`; built
    once, ~16 minutes on 2 cores)."""
    return Path(run([ROOT / "scripts" / "build-llamacpp", build]).strip().splitlines()[-1])


def default_model(binary):
    """lantern's default model (SmolLM2-135M-Instruct Q4_1), fetched on first use."""
    model = cache_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not model.exists():
        run([binary, "generate", "--prompt", "x", "--max-tokens", "1"])
    return str(model)


def lantern_bench(binary, model, threads, repeat, level="native", batches=(8, 32),
                  decode_tokens=128, prompt_tokens=512):
    """`lantern bench --json` at `threads` threads; `level` other than native is forced
    with LANTERN_KERNELS. Returns its JSON object."""
    env = dict(os.environ)
    env.pop("RAYON_NUM_THREADS", None)
    if level != "native":
        env["LANTERN_KERNELS"] = level
    out = run([binary, "bench", "--model", model, "--json", "--threads", str(threads),
               "--repeat", str(repeat), "--prompt-tokens", str(prompt_tokens),
               "--decode-tokens", str(decode_tokens),
               "--batches", ",".join(str(b) for b in batches)], env=env)
    return json.loads(out.strip().splitlines()[-1])


def llama_bench(bindir, model, threads, repeat, batches=(8, 32), decode_tokens=128,
                prompt_tokens=512, after_prompt=True):
    """llama-bench (prefill, decode at batch 1, and after the prompt unless
    `after_prompt` is false) and llama-batched-bench (aggregate decode of `batches`
    requests with 16-token prompts), read into lantern bench's keys."""
    common = ["-m", model, "-t", str(threads), "-r", str(repeat), "-o", "json"]
    pp_tg = json.loads(run([bindir / "llama-bench", "-p", str(prompt_tokens),
                            "-n", str(decode_tokens), *common]))
    rate = lambda rows, pred: next(r["avg_ts"] for r in rows if pred(r))
    figures = {
        "prefill_tokens_per_s": rate(pp_tg, lambda r: r["n_prompt"] == prompt_tokens),
        "decode_tokens_per_s": rate(pp_tg, lambda r: r["n_gen"] == decode_tokens),
        "batched_decode_tokens_per_s": {},
    }
    if after_prompt:
        deep = json.loads(run([bindir / "llama-bench", "-p", "0", "-n", str(decode_tokens),
                               "-d", str(prompt_tokens), *common]))
        figures["decode_after_prompt_tokens_per_s"] = rate(
            deep, lambda r: r["n_gen"] == decode_tokens)
    if batches:
        out = run([bindir / "llama-batched-bench", "-m", model, "-t", str(threads),
                   "-c", "8192", "-b", "2048", "-ub", "512", "-npp", "16",
                   "-ntg", str(decode_tokens), "-npl", ",".join(str(b) for b in batches),
                   "--output-format", "jsonl"])
        for line in out.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                figures["batched_decode_tokens_per_s"][str(row["pl"])] = row["speed_tg"]
    return figures


def cpu_line():
    """The CPU's model name, its logical CPUs and the vector flags the kernels care about."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    name = next((l.split(":", 1)[1].strip() for l in info.splitlines()
                 if l.startswith("model name")), "unknown CPU")
    flags = next((l.split(":", 1)[1].split() for l in info.splitlines()
                  if l.startswith("flags")), [])
    wanted = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
              "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
    return f"{name}, {os.cpu_count()} cores, flags: {' '.join(f for f in wanted if f in flags)}"


def physical_cores():
    """Physical cores this process may run on: distinct (package, core id) pairs of its
    CPUs in /sys, else its CPU count."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(),
                       (topo / "core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


PAIRED = [
    ("machine: multiply-adds", lambda r: r["machine_multiply_adds"]),
    ("machine: memory reads", lambda r: r["machine_memory_gb_per_s"]),
    ("prefill 512", lambda r: r["prefill"]),
    ("decode batch 1", lambda r: r["decode_batch_1"]),
    ("decode batch 32", lambda r: r["decode_batched"].get("32")),
]


def speedup_cell(f):
    """One paired figure of `lantern bench --thread-speedup` / `--kernel-speedup`: the
    median speedup and its rounds' range, or a dash when absent."""
    return f"{f['speedup']:.2f}x ({f['lowest']:.2f}-{f['highest']:.2f})" if f else "—"


def paired_table(rows):
    """Markdown table of lantern's paired speedups: rows are (threads, speedup JSON)."""
    lines = ["| threads | " + " | ".join(name for name, _ in PAIRED) + " |",
             "|---|" + "---|" * len(PAIRED)]
    for threads, result in rows:
        cells = [speedup_cell(get(result)) for _, get in PAIRED]
        lines.append(f"| 1 → {threads} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
