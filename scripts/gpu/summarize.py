#!/usr/bin/env python3
"""scripts/test-gpu's closing summary: its steps (a TSV of name, status, seconds, rc, note)
and the JSON the compare and bench steps wrote, as one JSON file and a table on stdout.

    summarize.py RESULTS.tsv SUMMARY.json WORKDIR BUNDLE_DIR

Exits 1 when a step failed or timed out.
"""
import json
import os
import subprocess
import sys


def load(path):
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except Exception as e:  # a half-written file from a step that was killed
        return {"error": f"{path}: {e}"}


def main(results, summary_path, work, bundle):
    steps = []
    with open(results) as f:
        for line in f:
            name, status, secs, rc, note = line.rstrip("\n").split("\t")
            steps.append({"step": name, "status": status, "seconds": int(secs),
                          "rc": None if rc == "-" else int(rc), "note": note})
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    manifest = load(os.path.join(bundle, "manifest.json")) or {}
    summary = {
        "gpu": gpu,
        "bundle": {k: manifest.get(k) for k in ("commit", "dirty", "features", "built_at")},
        "steps": steps,
        "passed": all(s["status"] in ("pass", "skipped") for s in steps),
        "compare": load(os.path.join(work, "compare.json")),
        "bench": load(os.path.join(work, "bench.json")),
    }
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1)
    print()
    print(f"{'step':<24} {'status':<8} {'secs':>5}  note")
    for s in steps:
        print(f"{s['step']:<24} {s['status']:<8} {s['seconds']:>5}  {s['note']}")
    for r in (summary["compare"] or {}).get("results", []):
        print(f"  compare {r.get('name', '?'):<34} {r.get('verdict', '?'):<9} {r.get('detail', '')}")
    for line in (summary["bench"] or {}).get("table", []):
        print(f"  bench {line}")
    print(f"summary: {summary_path}: {'all passed' if summary['passed'] else 'FAILURES'}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
