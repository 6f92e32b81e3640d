"""Panics are contained (a real server with its test-only fault plan): a panic on the
engine thread fails the requests in flight with a 500 (a stream with an error event)
saying an internal engine fault occurred, the engine restarts with every KV block free,
`/health` reports `degraded` until the engine has run CLEAN_STEPS_TO_RECOVER steps
without a panic, and later requests give what they gave before. A panic while
finalizing one capture fails that capture only. When the restart itself panics, the
engine stops: `/health` and every later request answer 503 at once."""

import threading
import time

import openai
import pytest
import requests

from conftest import start_server, stop_server

PROMPT = "The lighthouse keeper climbed the narrow stairs and lit the lamp, because"
# Steps 1-4: the reference request. The fault hits a step while both long requests run.
FAULT_STEP = 40
# crates/lantern-server/src/engine_thread.rs: clean steps after a panic before `ok`.
CLEAN_STEPS_TO_RECOVER = 32


@pytest.fixture(scope="module")
def faulty_server():
    srv = start_server(
        "--enable-attention-capture",
        "--inject-fault",
        f"panic-at-step:{FAULT_STEP},panic-at-capture:2",
    )
    yield srv
    stop_server(srv)


def greedy(client, srv, max_tokens, **kwargs):
    return client.completions.create(
        model=srv.model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, **kwargs.pop("extra_body", {})},
        **kwargs,
    )


def health(srv, headers=None):
    r = requests.get(srv.base_url + "/health", headers=headers, timeout=30)
    return r.status_code, r.json()


def test_a_panicking_step_fails_requests_in_flight_and_the_engine_restarts(faulty_server):
    srv = faulty_server
    client = srv.client()
    reference = greedy(client, srv, 4).choices[0].text
    assert health(srv) == (200, {"status": "ok"})

    # A whole request and a stream, both running when the fault hits.
    whole_error = {}

    def whole():
        try:
            greedy(client, srv, 400)
        except openai.APIStatusError as e:
            whole_error["e"] = e

    t = threading.Thread(target=whole)
    t.start()
    deadline = time.monotonic() + 30
    while srv.metrics()["vllm:num_requests_running"] < 1:
        assert time.monotonic() < deadline, "the whole request never ran"
        time.sleep(0.01)
    chunks = []
    with pytest.raises(openai.APIError) as streamed:
        for chunk in greedy(client, srv, 400, stream=True):
            chunks.append(chunk)
    t.join(timeout=60)
    assert chunks, "the stream failed before its first token"
    assert "internal engine fault" in str(streamed.value)

    e = whole_error.get("e")
    assert e is not None, "the whole request did not fail"
    assert e.status_code == 500
    assert e.body["code"] == "engine_fault"
    assert "internal engine fault" in e.body["message"]

    # Every block is back, and health says what happened; the panic's message only
    # to a client holding the API key.
    srv.wait_idle()
    status, body = health(srv)
    assert status == 200
    assert body["status"] == "degraded" and body["engine_faults"] == 1, body
    assert "last_engine_fault" not in body, body
    status, body = health(srv, srv.headers())
    assert status == 200 and "injected fault" in body["last_engine_fault"], body
    assert srv.metrics()["lantern:engine_faults_total"] == 1

    # The engine serves on, as it did before the fault.
    assert greedy(client, srv, 4).choices[0].text == reference
    srv.wait_idle()
    assert health(srv)[1]["status"] == "degraded"

    # Enough clean steps and health is ok again; the counter keeps the fault.
    greedy(client, srv, CLEAN_STEPS_TO_RECOVER)
    srv.wait_idle()
    assert health(srv) == (200, {"status": "ok"})
    assert srv.metrics()["lantern:engine_faults_total"] == 1


def test_a_panic_while_finalizing_fails_that_capture_only(faulty_server):
    srv = faulty_server
    client = srv.client()
    capture = {"attn_capture": True, "attn_capture_layers": "0"}
    results = [greedy(client, srv, 3, extra_body=capture).model_dump() for _ in range(3)]
    assert results[0].get("attn_capture_data"), results[0].keys()
    assert "attn_capture_data" not in results[1]
    assert "internal fault" in results[1]["attn_capture_error"]
    # The text of the failed capture's request is still good.
    assert results[1]["choices"][0]["text"] == results[0]["choices"][0]["text"]
    assert results[2].get("attn_capture_data"), results[2].keys()
    assert srv.metrics()["lantern:attention_capture_failures_total"] >= 1
    assert srv.metrics()["lantern:capture_worker_faults_total"] == 1


def test_a_panic_while_restarting_stops_the_engine_and_everything_answers_503():
    srv = start_server("--inject-fault", "panic-at-step:3,panic-at-reset:1")
    try:
        client = srv.client()
        with pytest.raises(openai.APIStatusError) as failed:
            greedy(client, srv, 20)
        assert failed.value.status_code == 500
        assert failed.value.body["code"] == "engine_fault"
        assert "could not restart" in failed.value.body["message"]

        status, body = health(srv)
        assert status == 503 and body["error"]["code"] == "engine_stopped", body
        # Later requests fail at once with the same clear error, never hang.
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            greedy(client, srv, 4, stream=True)
        assert time.monotonic() - started < 5
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "engine_stopped"
        assert "restart the server" in refused.value.body["message"]
        assert requests.get(srv.base_url + "/metrics", timeout=30).status_code == 503
    finally:
        stop_server(srv)
