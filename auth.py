import requests, json
B = "http://127.0.0.1:8460/v1"
H = lambda k: {"Authorization": f"Bearer {k}"}
r = requests.post(f"{B}/completions", headers=H("KA"), json={"prompt": "The capital of France is", "max_tokens": 3, "attn_capture": True, "attn_capture_delivery": "reference"}).json()
print("default layers", r["attn_capture_meta"]["layers"]); cid = r["attn_capture_id"]
for k in (None, "bogus", "KB", "KA"):
    rr = requests.get(f"{B}/captures/{cid}", headers=H(k) if k else {}); print("GET", k, rr.status_code, rr.text[:200] if rr.status_code != 200 else "")
rr = requests.get(f"{B}/captures/{cid}/view"); print("VIEW nokey", rr.status_code)
rr = requests.delete(f"{B}/captures/{cid}", headers=H("KB")); print("DEL KB", rr.status_code)
# stop early
for rows in ("0:20", "5:"):
    r = requests.post(f"{B}/completions", headers=H("KA"), json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stop": ["."], "attn_capture": True, "attn_capture_layers": [0], "attn_capture_rows": rows}).json()
    m = r["attn_capture_meta"]; print(rows, repr(r["choices"][0]["text"]), r["choices"][0]["finish_reason"], m["total_len"], m["row_positions"], m["absent_rows"][:3], len(m["absent_rows"]))
