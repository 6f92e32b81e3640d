"""Unit tests of the Python package clients/python (lantern_attn), with no server.

Captures are synthesized with numpy and encoded here by hand, exactly as the wire format
contract says (docs/capture-format.md): gzip+base64 JSON for inline delivery, and
safetensors written with struct/json. The helper must decode them bit-exactly and refuse
malformed input with a ValueError that says what is wrong. None of these tests uses the
`server` fixture of conftest.py.
"""

import base64
import gzip
import html
import http.server
import json
import re
import struct
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python"))
import lantern_attn  # noqa: E402

FORMAT = "lantern.attn_capture.v1"
LAYERS = [0, 3, 7]
HEADS = [0, 2, 5]


def make_capture(seed=0, total=11, prompt=7, reduce="none", top_k=None, dtype="float32", rows=None):
    """A capture as the engine would finish it: `rows` (default every position but the
    last, which never ran), keys 0..total-1, causal maps with random values. Returns
    (meta, maps, indices, full): maps in the wire dtype, full the dense float32 maps
    before top-k (rounded to the dtype)."""
    rng = np.random.default_rng(seed)
    rows = list(range(total - 1)) if rows is None else list(rows)
    keys = total - 1
    heads = len(HEADS) if reduce == "none" else 1
    np_dtype = np.float16 if dtype == "float16" else np.float32
    maps, indices, full = {}, {}, {}
    for layer in LAYERS:
        m = rng.random((len(rows), heads, keys), dtype=np.float32) ** 2
        m *= (np.arange(keys)[None, :] <= np.array(rows)[:, None])[:, None, :]
        m /= np.maximum(m.sum(axis=-1, keepdims=True), 1e-30)
        m = m.astype(np_dtype)
        full[layer] = m.astype(np.float32)
        if top_k is not None:
            k = min(top_k, keys)
            order = np.argsort(-m.astype(np.float32), axis=-1, kind="stable")[..., :k]
            m = np.take_along_axis(m, order, axis=-1)
            indices[layer] = order.astype(np.int32)
        maps[layer] = m
    meta = {
        "format": FORMAT,
        "prompt_len": prompt,
        "total_len": total,
        "tokens": [{"id": 1000 + i, "text": f" t{i}" if i % 3 else "é\n'\""} for i in range(total)],
        "layers": LAYERS,
        "heads": HEADS,
        "reduce": reduce,
        "top_k": top_k,
        "dtype": dtype,
        "row_positions": rows,
        "key_positions": list(range(keys)),
        "absent_rows": [
            {"position": total - 1, "reason": "the last generated token was never run through the model"}
        ],
        "layer_attention": [
            {
                "layer_idx": layer,
                "scale": 0.125,
                "sliding_window": 4 if layer == 3 else None,
                "chunk_size": None,
                "logits_soft_cap": 30.0,
                "has_sinks": False,
                "num_heads": 9,
                "num_kv_heads": 3,
            }
            for layer in LAYERS
        ],
    }
    return meta, maps, indices, full


def le_bytes(array, dtype):
    return np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def pack(raw: bytes) -> str:
    return base64.b64encode(gzip.compress(raw)).decode("ascii")


def wire_dtype(meta):
    return "<f2" if meta["dtype"] == "float16" else "<f4"


def inline_response(meta, maps, indices):
    """A completions response with the capture inline, as the contract gives it."""
    data = []
    for layer in meta["layers"]:
        entry = {
            "layer_idx": layer,
            "shape": list(maps[layer].shape),
            "dtype": meta["dtype"],
            "encoding": "gzip+base64",
            "data": pack(le_bytes(maps[layer], wire_dtype(meta))),
        }
        if layer in indices:
            entry["indices"] = pack(le_bytes(indices[layer], "<i4"))
            entry["indices_dtype"] = "int32"
        data.append(entry)
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": " hi", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": meta["prompt_len"], "completion_tokens": 4, "total_tokens": 11},
        "attn_capture_data": data,
        "attn_capture_meta": meta,
    }


def safetensors_bytes(meta, maps, indices, reverse=False, pad=True, extra_metadata=None):
    """The safetensors file of the contract, by hand."""
    metadata = {"format": FORMAT, "lantern.capture": json.dumps(meta)}
    metadata.update(extra_metadata or {})
    header = {"__metadata__": metadata}
    st = "F16" if meta["dtype"] == "float16" else "F32"
    tensors = []
    for layer in meta["layers"]:
        tensors.append((f"layer.{layer}", st, maps[layer], wire_dtype(meta)))
        if layer in indices:
            tensors.append((f"layer.{layer}.indices", "I32", indices[layer], "<i4"))
    if reverse:
        tensors.reverse()
    blobs, offset = [], 0
    for name, st_dtype, array, dt in tensors:
        raw = le_bytes(array, dt)
        header[name] = {"dtype": st_dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def read_safetensors(data: bytes):
    """A minimal independent reader, to check files the helper writes."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    metadata = header.pop("__metadata__")
    dtypes = {"F32": "<f4", "F16": "<f2", "I32": "<i4"}
    tensors = {}
    for name, t in header.items():
        a, b = t["data_offsets"]
        tensors[name] = (t["dtype"], np.frombuffer(body[a:b], dtype=dtypes[t["dtype"]]).reshape(t["shape"]))
    return metadata, tensors


def assert_bit_equal(got, want, dtype):
    want = np.asarray(want, dtype=np.dtype(dtype).newbyteorder("<"))
    assert got.shape == want.shape
    assert got.dtype == want.dtype.newbyteorder("=")
    assert got.tobytes() == want.astype(got.dtype).tobytes()


def check_capture(cap, meta, maps, indices):
    assert cap.meta == meta
    assert list(cap.layers) == meta["layers"]
    for layer in meta["layers"]:
        assert_bit_equal(cap.layers[layer], maps[layer], wire_dtype(meta))
        if meta["top_k"] is None:
            assert cap.indices == {}
        else:
            assert_bit_equal(cap.indices[layer], indices[layer], "<i4")
            assert cap.indices[layer].dtype == np.int32


CASES = [
    dict(reduce="none", top_k=None, dtype="float32"),
    dict(reduce="none", top_k=None, dtype="float16"),
    dict(reduce="mean_heads", top_k=None, dtype="float32"),
    dict(reduce="max_heads", top_k=None, dtype="float16"),
    dict(reduce="none", top_k=3, dtype="float32"),
    dict(reduce="none", top_k=4, dtype="float16"),
    dict(reduce="mean_heads", top_k=2, dtype="float32"),
    dict(reduce="none", top_k=50, dtype="float32"),  # k above the key count: keys
    dict(reduce="none", top_k=None, dtype="float32", rows=range(7, 10)),  # "generated"
    dict(reduce="none", top_k=None, dtype="float16", rows=range(0, 7)),  # "prompt"
    dict(reduce="none", top_k=2, dtype="float32", rows=[]),  # a range past the end
]


@pytest.fixture(params=range(len(CASES)), ids=lambda i: "-".join(map(str, CASES[i].values())))
def case(request):
    return make_capture(seed=request.param, **CASES[request.param])


# ----------------------------------------------------------------------------- decoding


def test_inline_decodes_bit_exactly(case):
    meta, maps, indices, _ = case
    resp = inline_response(meta, maps, indices)
    check_capture(lantern_attn.from_response(resp), meta, maps, indices)
    # Through JSON text, as it arrives.
    text = json.dumps(resp)
    check_capture(lantern_attn.from_response(json.loads(text)), meta, maps, indices)
    check_capture(lantern_attn.from_response(text), meta, maps, indices)


def test_inline_arrays_are_writable(case):
    meta, maps, indices, _ = case
    cap = lantern_attn.from_response(inline_response(meta, maps, indices))
    for m in cap.layers.values():
        assert m.flags.writeable


def test_safetensors_path_is_memory_mapped_and_bit_exact(case, tmp_path):
    meta, maps, indices, _ = case
    path = tmp_path / "cap.safetensors"
    data = safetensors_bytes(meta, maps, indices, reverse=True)
    path.write_bytes(data)
    cap = lantern_attn.load(path)
    check_capture(cap, meta, maps, indices)
    check_capture(lantern_attn.load(str(path)), meta, maps, indices)
    for m in cap.layers.values():
        if m.size:
            base, mapped = m, False
            while base is not None:
                mapped |= isinstance(base, np.memmap)
                base = getattr(base, "base", None)
            assert mapped, "a file is memory-mapped"
            m[...] = 0  # copy-on-write: the file never changes
    assert path.read_bytes() == data


def test_safetensors_bytes_decode_bit_exactly(case):
    meta, maps, indices, _ = case
    data = safetensors_bytes(meta, maps, indices, pad=False)
    check_capture(lantern_attn.load(data), meta, maps, indices)
    check_capture(lantern_attn.load(bytearray(data)), meta, maps, indices)
    check_capture(lantern_attn.load(memoryview(data)), meta, maps, indices)


def test_file_delivery_reads_the_path(case, tmp_path):
    meta, maps, indices, _ = case
    path = tmp_path / "lantern-capture-x.safetensors"
    path.write_bytes(safetensors_bytes(meta, maps, indices))
    resp = {"choices": [], "attn_capture_path": str(path), "attn_capture_expires_in": 600, "attn_capture_meta": meta}
    check_capture(lantern_attn.from_response(resp), meta, maps, indices)


def test_json_file_loads_too(tmp_path):
    meta, maps, indices, _ = make_capture(top_k=3)
    path = tmp_path / "resp.json"
    path.write_text(json.dumps(inline_response(meta, maps, indices)))
    check_capture(lantern_attn.load(path), meta, maps, indices)


def test_unknown_extra_metadata_and_tensors_are_ignored():
    meta, maps, indices, _ = make_capture()
    data = safetensors_bytes(meta, maps, indices, extra_metadata={"note": "x"})
    check_capture(lantern_attn.load(data), meta, maps, indices)


class _Pydantic:
    """Stands in for an openai response object: extras come out of model_dump()."""

    def __init__(self, d):
        self._d = d

    def model_dump(self):
        return json.loads(json.dumps(self._d))


def test_openai_style_objects_and_streams():
    meta, maps, indices, _ = make_capture(dtype="float16", top_k=2, seed=4)
    resp = inline_response(meta, maps, indices)
    check_capture(lantern_attn.from_response(_Pydantic(resp)), meta, maps, indices)
    # A stream: a chunk of its own after the last token's carries the capture, and with
    # include_usage the usage chunk comes after it.
    chunks = [{"choices": [{"index": 0, "text": t}]} for t in (" a", " b")]
    last = {k: v for k, v in resp.items() if k != "choices"}
    last["choices"] = []
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}
    check_capture(lantern_attn.from_response(last), meta, maps, indices)
    check_capture(lantern_attn.from_response(chunks + [last]), meta, maps, indices)
    check_capture(lantern_attn.from_response(chunks + [last, usage]), meta, maps, indices)
    check_capture(lantern_attn.from_response([_Pydantic(c) for c in chunks + [last]]), meta, maps, indices)
    with pytest.raises(ValueError, match="streamed chunks"):
        lantern_attn.from_response(chunks)
    with pytest.raises(ValueError, match="pass the list of chunks"):
        lantern_attn.from_response(usage)


def test_real_openai_response_object():
    openai = pytest.importorskip("openai")
    meta, maps, indices, _ = make_capture(reduce="mean_heads")
    resp = inline_response(meta, maps, indices)
    obj = openai.types.Completion.model_validate(resp)
    check_capture(lantern_attn.from_response(obj), meta, maps, indices)


# ----------------------------------------------------------------------------- Capture


def test_capture_properties():
    meta, maps, indices, _ = make_capture(total=11, prompt=7)
    cap = lantern_attn.from_response(inline_response(meta, maps, indices))
    assert cap.prompt_len == 7 and cap.total_len == 11
    assert list(cap.token_ids) == [1000 + i for i in range(11)]
    assert cap.token_ids.dtype == np.int64
    assert cap.tokens[1] == " t1" and len(cap.tokens) == 11
    assert list(cap.row_positions) == list(range(10))
    assert list(cap.key_positions) == list(range(10))
    assert cap.row_labels[1] == "1:' t1'"
    assert cap.key_labels[0] == "0:" + repr("é\n'\"")
    assert len(cap.key_labels) == 10
    assert [a["position"] for a in cap.absent_rows] == [10]
    assert cap.heads == HEADS and cap.reduce == "none" and cap.top_k is None and cap.dtype == "float32"
    assert cap.layer_attention(3)["sliding_window"] == 4
    text = repr(cap)
    assert "[0, 3, 7]" in text and "total_len=11" in text and "float32" in text


def test_dense_without_top_k_is_the_map_in_float32():
    for dtype in ("float32", "float16"):
        meta, maps, indices, full = make_capture(dtype=dtype)
        cap = lantern_attn.from_response(inline_response(meta, maps, indices))
        for layer in LAYERS:
            d = cap.dense(layer)
            assert d.dtype == np.float32
            np.testing.assert_array_equal(d, full[layer])
            d[...] = 7  # a new array
            assert not np.any(cap.layers[layer] == 7)
    with pytest.raises(KeyError):
        cap.dense(99)


@pytest.mark.parametrize("k", [1, 3, 10, 50])
def test_dense_scatters_top_k(k):
    meta, maps, indices, full = make_capture(top_k=k, dtype="float16", seed=k)
    cap = lantern_attn.from_response(inline_response(meta, maps, indices))
    for layer in LAYERS:
        d = cap.dense(layer)
        assert d.shape == full[layer].shape and d.dtype == np.float32
        keep = np.zeros(full[layer].shape, dtype=bool)
        np.put_along_axis(keep, indices[layer].astype(np.int64), True, axis=-1)
        np.testing.assert_array_equal(d, np.where(keep, full[layer], 0))
        if k >= full[layer].shape[-1]:
            np.testing.assert_array_equal(d, full[layer])


def test_dense_follows_key_positions():
    """Top-k indices are key positions, mapped to columns through key_positions."""
    meta, maps, indices, _ = make_capture(top_k=2)
    meta = dict(meta, key_positions=[p + 100 for p in meta["key_positions"]])
    indices = {l: i + 100 for l, i in indices.items()}
    cap = lantern_attn.from_response(inline_response(meta, maps, indices))
    d = cap.dense(0)
    rows = np.arange(d.shape[0])[:, None, None]
    heads = np.arange(d.shape[1])[None, :, None]
    np.testing.assert_array_equal(d[rows, heads, indices[0] - 100], maps[0])
    bad = dict(meta, key_positions=[p + 1 for p in meta["key_positions"]])
    cap = lantern_attn.from_response(inline_response(bad, maps, indices))
    with pytest.raises(ValueError, match="key_positions"):
        cap.dense(0)


# ----------------------------------------------------------------------------- writing


def test_save_safetensors_writes_the_contract(case, tmp_path):
    meta, maps, indices, _ = case
    cap = lantern_attn.from_response(inline_response(meta, maps, indices))
    path = tmp_path / "out.safetensors"
    lantern_attn.save_safetensors(cap, path)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert (8 + n) % 8 == 0
    metadata, tensors = read_safetensors(data)
    assert metadata["format"] == FORMAT
    assert json.loads(metadata["lantern.capture"]) == meta
    want = {f"layer.{l}" for l in LAYERS} | ({f"layer.{l}.indices" for l in LAYERS} if indices else set())
    assert set(tensors) == want
    for layer in LAYERS:
        st, array = tensors[f"layer.{layer}"]
        assert st == ("F16" if meta["dtype"] == "float16" else "F32")
        assert_bit_equal(array, maps[layer], wire_dtype(meta))
        if indices:
            st, array = tensors[f"layer.{layer}.indices"]
            assert st == "I32"
            assert_bit_equal(array, indices[layer], "<i4")
    check_capture(lantern_attn.load(path), meta, maps, indices)


def test_to_npz_reads_back_without_pickle(tmp_path):
    meta, maps, indices, _ = make_capture(top_k=3, dtype="float16")
    cap = lantern_attn.from_response(inline_response(meta, maps, indices))
    path = tmp_path / "cap.npz"
    lantern_attn.to_npz(cap, path)
    with np.load(path, allow_pickle=False) as z:
        assert json.loads(str(z["meta"])) == meta
        for layer in LAYERS:
            assert_bit_equal(z[f"layer_{layer}"], maps[layer], "<f2")
            assert_bit_equal(z[f"layer_{layer}.indices"], indices[layer], "<i4")


# ----------------------------------------------------------------------------- fetch


class _Handler(http.server.BaseHTTPRequestHandler):
    store = {}
    key = "secret"
    seen = []

    def log_message(self, *args):
        pass

    def _reply(self, status, body, kind):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status, message):
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}})
        self._reply(status, body.encode(), "application/json")

    def _capture(self):
        self.seen.append((self.command, self.path, self.headers.get("Authorization")))
        prefix = "/v1/captures/"
        if self.headers.get("Authorization") != f"Bearer {self.key}":
            self._error(401, "Incorrect API key provided.")
            return None
        cid = self.path[len(prefix) :] if self.path.startswith(prefix) else ""
        if cid not in self.store:
            self._error(404, f"no capture `{cid}`: it never existed, expired, was deleted, or belongs to another API key")
            return None
        return cid

    def do_GET(self):
        cid = self._capture()
        if cid is not None:
            self._reply(200, self.store[cid], "application/octet-stream")

    def do_DELETE(self):
        cid = self._capture()
        if cid is not None:
            del self.store[cid]
            self._reply(200, json.dumps({"id": cid, "object": "capture", "deleted": True}).encode(), "application/json")


@pytest.fixture
def capture_http():
    """A stand-in for the capture endpoints (stdlib http.server, not lantern)."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    _Handler.store.clear()
    _Handler.seen.clear()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def test_fetch_and_delete(capture_http):
    meta, maps, indices, _ = make_capture(top_k=2, dtype="float16")
    cid = "cap-" + "ab" * 16
    _Handler.store[cid] = safetensors_bytes(meta, maps, indices)
    cap = lantern_attn.fetch(capture_http + "/", cid, api_key="secret")
    check_capture(cap, meta, maps, indices)
    assert _Handler.seen[-1] == ("GET", f"/v1/captures/{cid}", "Bearer secret")
    # A response object carrying the id works too.
    check_capture(lantern_attn.fetch(capture_http, {"attn_capture_id": cid}, api_key="secret"), meta, maps, indices)
    with pytest.raises(lantern_attn.FetchError, match="Incorrect API key") as e:
        lantern_attn.fetch(capture_http, cid)
    assert e.value.status == 401
    lantern_attn.delete(capture_http, cid, api_key="secret")
    with pytest.raises(lantern_attn.FetchError, match="no capture") as e:
        lantern_attn.fetch(capture_http, cid, api_key="secret")
    assert e.value.status == 404


def test_reference_response_says_to_fetch():
    meta, _, _, _ = make_capture()
    resp = {"choices": [], "attn_capture_id": "cap-" + "0" * 32, "attn_capture_meta": meta}
    with pytest.raises(ValueError, match=r"fetch\("):
        lantern_attn.from_response(resp)


# ----------------------------------------------------------------------------- malformed


def inline_error(edit, **kwargs):
    meta, maps, indices, _ = make_capture(**kwargs)
    resp = json.loads(json.dumps(inline_response(meta, maps, indices)))
    edit(resp)
    with pytest.raises(ValueError) as e:
        lantern_attn.from_response(resp)
    assert isinstance(e.value, lantern_attn.CaptureError)
    return str(e.value)


def data0(resp):
    return resp["attn_capture_data"][0]


def test_malformed_inline_is_a_value_error():
    def setm(**kv):
        return lambda r: r["attn_capture_meta"].update(kv)

    def set0(**kv):
        return lambda r: data0(r).update(kv)

    assert "no attention capture" in inline_error(lambda r: r.pop("attn_capture_data"))
    assert "attn_capture_meta" in inline_error(lambda r: r.pop("attn_capture_meta"))
    assert "could not compute" in inline_error(lambda r: r.update(attn_capture_error="boom"))
    assert "format" in inline_error(setm(format="other"))
    assert "dtype" in inline_error(setm(dtype="int8"))
    assert "missing" in inline_error(lambda r: r["attn_capture_meta"].pop("tokens"))
    assert "3 layers" in inline_error(setm(layers=[0]))
    assert "row_positions" in inline_error(setm(row_positions=[-1]))
    assert "top_k" in inline_error(setm(top_k=0))
    assert "not a list" in inline_error(lambda r: r.update(attn_capture_data={"a": 1}))
    assert "layer_idx" in inline_error(set0(layer_idx=5))
    assert "dtype" in inline_error(set0(dtype="float16"))
    assert "encoding" in inline_error(set0(encoding="raw"))
    assert "'data'" in inline_error(lambda r: data0(r).pop("data"))
    assert "shape" in inline_error(set0(shape=[10, 3]))
    assert "shape" in inline_error(set0(shape=[10, -3, 10]))
    assert "too large" in inline_error(set0(shape=[2**40, 2**40, 3]))
    assert "base64" in inline_error(set0(data="not base64!"))
    assert "gzip" in inline_error(set0(data=base64.b64encode(b"plain").decode()))
    truncated = lambda r: data0(r).update(
        data=base64.b64encode(base64.b64decode(data0(r)["data"])[:-20]).decode()
    )
    assert "gzip" in inline_error(truncated)
    assert "more than" in inline_error(set0(shape=[10, 3, 9]))
    assert "need" in inline_error(set0(shape=[10, 3, 11]))
    # Consistent with its data, but not with the meta.
    e = inline_error(set0(shape=[10, 1, 30], data=pack(b"\0" * 10 * 30 * 4)))
    assert "does not match the meta" in e
    # A decompression bomb stops at the size the shape needs.
    assert "more than" in inline_error(set0(data=pack(b"\0" * 50_000_000)))
    # Top-k.
    assert "indices" in inline_error(lambda r: data0(r).pop("indices"), top_k=3)
    assert "indices_dtype" in inline_error(set0(indices_dtype="int64"), top_k=3)
    neg = pack(le_bytes(-np.ones((10, 3, 3)), "<i4"))
    assert "negative" in inline_error(set0(indices=neg), top_k=3)
    assert "no 'indices'" not in inline_error(set0(indices="@@"), top_k=3)


def test_wrong_types_are_refused():
    with pytest.raises(TypeError):
        lantern_attn.from_response(42)
    with pytest.raises(TypeError):
        lantern_attn.load(42)
    with pytest.raises(ValueError, match="JSON"):
        lantern_attn.from_response("not json")
    with pytest.raises(ValueError, match="JSON object"):
        lantern_attn.from_response("[1, 2]")


def st_error(data):
    with pytest.raises(ValueError) as e:
        lantern_attn.load(data)
    assert isinstance(e.value, lantern_attn.CaptureError)
    return str(e.value)


def raw_safetensors(header: dict, body: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def test_malformed_safetensors_is_a_value_error(tmp_path):
    meta, maps, indices, _ = make_capture(top_k=2)
    good = safetensors_bytes(meta, maps, indices)
    assert "not a safetensors" in st_error(b"")
    assert "not a safetensors" in st_error(b"\x01\x02")
    assert "not a safetensors" in st_error(good[:-1])
    assert "beyond the end" in st_error(struct.pack("<Q", 10**6) + b"{}")
    assert "not JSON" in st_error(struct.pack("<Q", 2) + b"{x")
    assert "not a JSON object" in st_error(raw_safetensors([1]))  # type: ignore[arg-type]
    m = json.dumps(meta)
    values = b"\0" * (10 * 3 * 2 * 4)
    t = lambda dt, shape, n, off=0: {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}  # noqa: E731
    assert "metadata" in st_error(raw_safetensors({"layer.0": t("F32", [10, 3, 2], 240)}, values))
    assert "not JSON" in st_error(raw_safetensors({"__metadata__": {"lantern.capture": "{"}}))
    assert "'layer.0'" in st_error(raw_safetensors({"__metadata__": {"lantern.capture": m}}))
    meta_md = {"__metadata__": {"lantern.capture": m}}
    e = st_error(raw_safetensors({**meta_md, "layer.0": t("F16", [10, 3, 2], 120)}, values[:120]))
    assert "F16" in e
    e = st_error(raw_safetensors({**meta_md, "layer.0": t("F32", [10, 3, 2], 240)}, values))
    assert "indices" in e
    both = lambda dt_i, shape_i: {  # noqa: E731
        **meta_md,
        "layer.0": t("F32", [10, 3, 2], 240),
        "layer.0.indices": t(dt_i, shape_i, 240, 240),
    }
    assert "expected I32" in st_error(raw_safetensors(both("F32", [10, 3, 2]), values * 2))
    assert "expected I32" in st_error(raw_safetensors(both("I32", [10, 6]), values * 2))
    e = st_error(raw_safetensors({**meta_md, "layer.0": t("F32", [10, 6], 240)}, values))
    assert "not [rows, heads, keys]" in e
    wrong = {**meta_md, "layer.0": t("F32", [3, 10, 2], 240), "layer.0.indices": t("I32", [3, 10, 2], 240, 240)}
    assert "does not match the meta" in st_error(raw_safetensors(wrong, values * 2))
    assert "out of range" in st_error(raw_safetensors({**meta_md, "layer.0": t("F32", [10, 3, 2], 240)}, values[:100]))
    assert "need" in st_error(raw_safetensors({**meta_md, "layer.0": t("F32", [10, 3, 2], 200)}, values))
    assert "unsupported" in st_error(raw_safetensors({**meta_md, "layer.0": t("F8_E4M3", [1], 1)}, b"\0"))
    # A path names itself in the error.
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw_safetensors({"__metadata__": {}}))
    with pytest.raises(ValueError, match="bad.safetensors"):
        lantern_attn.load(path)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        lantern_attn.load(empty)


def test_random_corruption_only_raises_value_errors():
    rng = np.random.default_rng(0)
    meta, maps, indices, _ = make_capture(top_k=3, dtype="float16")
    good = bytearray(safetensors_bytes(meta, maps, indices))
    for _ in range(400):
        data = bytearray(good)
        for _ in range(rng.integers(1, 4)):
            data[rng.integers(0, len(data))] = rng.integers(0, 256)
        cut = int(rng.integers(0, len(data) + 1))
        for candidate in (bytes(data), bytes(data[:cut])):
            try:
                cap = lantern_attn.load(candidate)
            except ValueError:
                continue
            for layer in cap.layers:
                try:
                    cap.dense(layer)
                except ValueError:
                    pass


# ----------------------------------------------------------------------------- other shapes


@pytest.mark.parametrize(
    "kind", [dict(), dict(top_k=3), dict(reduce="mean_heads", dtype="float16"), dict(rows=[2, 3, 4])]
)
def test_to_hf_is_transformers_output_attentions(kind):
    """One float32 [1, heads, total, total] per layer: row p, column k is the capture's
    probability of query p for key k; rows without probabilities are zeros, listed."""
    meta, maps, indices, full = make_capture(seed=11, **kind)
    cap = lantern_attn.from_response(inline_response(meta, maps, indices))
    attentions = cap.to_hf()
    assert isinstance(attentions, tuple) and len(attentions) == len(LAYERS)
    assert attentions.layers == LAYERS and attentions.heads == HEADS
    heads = 1 if meta["reduce"] != "none" else len(HEADS)
    rows = meta["row_positions"]
    assert attentions.absent_rows == [p for p in range(meta["total_len"]) if p not in rows]
    for layer, a in zip(LAYERS, attentions):
        assert isinstance(a, np.ndarray) and a.dtype == np.float32
        assert a.shape == (1, heads, meta["total_len"], meta["total_len"])
        expected = np.zeros_like(a)
        dense = full[layer]
        if meta["top_k"]:
            dense = cap.dense(layer)  # the kept values only
        for i, p in enumerate(rows):
            expected[0, :, p, : dense.shape[-1]] = dense[i]
        np.testing.assert_array_equal(a, expected)
        for p in attentions.absent_rows:
            assert not a[0, :, p].any()


def test_to_hf_and_bertviz_with_torch_or_without():
    """bertviz takes torch tensors only: without torch, to_bertviz() refuses as
    to_hf(return_tensors="pt") does (test_helper_edges.py runs both cases)."""
    meta, maps, indices, _ = make_capture(seed=12)
    cap = lantern_attn.from_response(inline_response(meta, maps, indices))
    with pytest.raises(ValueError, match="return_tensors"):
        cap.to_hf(return_tensors="tf")
    try:
        import torch
    except ImportError:
        with pytest.raises(ImportError, match="torch"):
            cap.to_hf(return_tensors="pt")
        with pytest.raises(ImportError, match="torch"):
            cap.to_bertviz()
        return
    attention, tokens = cap.to_bertviz()
    assert tokens == cap.tokens and len(tokens) == meta["total_len"]
    assert all(isinstance(a, torch.Tensor) for a in attention)
    for ours, theirs in zip(cap.to_hf(), cap.to_hf(return_tensors="pt")):
        np.testing.assert_array_equal(ours, theirs.numpy())


def test_to_html_is_the_viewer_with_the_capture_inside():
    meta, maps, indices, _ = make_capture(seed=13, top_k=2)
    meta["tokens"][1]["text"] = "</script><script>window.hacked=1</script>"
    cap = lantern_attn.from_response(inline_response(meta, maps, indices))
    page = cap.to_html(title="my capture")
    assert page.startswith("<!doctype html>")
    assert "/*LANTERN_CAPTURE_JSON*/" not in page
    assert "<script src" not in page and "http://" not in page and "https://" not in page
    assert "window.hacked" in page and "</script><script>window.hacked" not in page
    slot = re.search(r'<script type="application/json" id="capture">(.*?)</script>', page, re.S)
    data = json.loads(slot.group(1))
    assert data["source"] == "my capture" and data["meta"] == meta
    for entry, layer in zip(data["layers"], LAYERS):
        values = np.frombuffer(base64.b64decode(entry["values"]), dtype="<f4").reshape(entry["shape"])
        np.testing.assert_array_equal(values, maps[layer].astype(np.float32))
        idx = np.frombuffer(base64.b64decode(entry["indices"]), dtype="<i4").reshape(entry["shape"])
        np.testing.assert_array_equal(idx, indices[layer])
    frame = cap._repr_html_()
    assert frame.startswith("<iframe srcdoc=") and "&lt;!doctype html&gt;" in frame
    assert html.unescape(re.search(r'srcdoc="([^"]*)"', frame).group(1)) == cap.to_html()
