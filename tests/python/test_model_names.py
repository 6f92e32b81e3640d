"""Model names as vLLM gives them: the served name is `--model` as given (the default
model: its file stem), `--served-model-name` may give several (the first is the one
reported), a request naming any of them is served, another name is a 404, and
`/v1/models` lists vLLM's ModelCard fields."""

import openai
import pytest
import requests

from conftest import API_KEY, start_server, stop_server

# A tiny random-weight Llama (a Hugging Face directory), relative to the repository
# root, where the server runs: it loads in a moment.
TINY = "tests/fixtures/archs/llama/hf"
DEFAULT_NAME = "SmolLM2-135M-Instruct.Q4_1"
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def started():
    """Starts servers for one test and stops them after it."""
    servers = []

    def start(*args):
        srv = start_server(*args, served_model_name=None)
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        stop_server(srv)


def models(srv) -> list:
    r = requests.get(srv.base_url + "/v1/models", headers=srv.headers(), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def serving_line(srv) -> str:
    lines = [l for l in srv.startup_lines if "lantern: serving" in l]
    assert len(lines) == 1, srv.startup_lines
    return lines[0].strip()


def test_the_default_model_is_named_by_its_file_stem(started):
    srv = started()
    cards = models(srv)
    assert [c["id"] for c in cards] == [DEFAULT_NAME]
    assert serving_line(srv) == f"lantern: serving {DEFAULT_NAME}"
    client = srv.client()
    r = client.completions.create(model=DEFAULT_NAME, prompt="Hi", max_tokens=2, temperature=0)
    assert r.model == DEFAULT_NAME
    # A request without `model` is still served, as before.
    r = requests.post(
        srv.base_url + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2},
        headers=srv.headers(),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == DEFAULT_NAME


def test_a_model_is_named_by_model_as_given(started):
    srv = started("--model", TINY)
    (card,) = models(srv)
    assert card["id"] == TINY
    assert serving_line(srv) == f"lantern: serving {TINY}"
    client = srv.client()
    # The name holds slashes: /v1/models/{name} still finds it.
    assert client.models.retrieve(TINY).id == TINY
    r = client.chat.completions.create(model=TINY, messages=USER, max_tokens=2)
    assert r.model == TINY


def test_model_cards_have_vllms_fields(started):
    srv = started("--model", TINY)
    (card,) = models(srv)
    assert list(card) == [
        "id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission",
    ]
    assert card["object"] == "model"
    assert card["root"] == TINY
    assert card["parent"] is None
    assert card["max_model_len"] > 0
    (permission,) = card["permission"]
    assert permission["id"].startswith("modelperm-")
    assert permission["object"] == "model_permission"
    assert {k: v for k, v in permission.items() if k not in ("id", "created")} == {
        "object": "model_permission",
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    # The same card every time it is asked for.
    assert models(srv) == [card]


def test_several_served_names_are_all_accepted_and_the_first_is_reported(started):
    srv = started("--model", TINY, "--served-model-name", "first", "second")
    assert [c["id"] for c in models(srv)] == ["first", "second"]
    assert all(c["root"] == TINY for c in models(srv))
    assert serving_line(srv) == "lantern: serving first, second"
    client = srv.client()
    assert client.models.retrieve("second").id == "second"
    r = client.completions.create(model="second", prompt="Hi", max_tokens=2)
    assert r.model == "first"
    r = client.chat.completions.create(model="second", messages=USER, max_tokens=2)
    assert r.model == "first"
    tokens = requests.post(
        srv.base_url + "/tokenize",
        json={"model": "second", "prompt": "Hi"},
        headers=srv.headers(),
        timeout=30,
    )
    assert tokens.status_code == 200, tokens.text
    # The name of the model file is not one of them any more.
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=TINY, prompt="Hi", max_tokens=2)


def test_an_unknown_model_is_a_404_worded_as_vllms(started):
    srv = started("--model", TINY)
    client = srv.client()
    for call in (
        lambda: client.completions.create(model="nope", prompt="Hi", max_tokens=2),
        lambda: client.chat.completions.create(model="nope", messages=USER, max_tokens=2),
        lambda: client.models.retrieve("nope"),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        error = e.value.body.get("error", e.value.body)
        assert error["message"] == "The model `nope` does not exist."
        assert error["param"] == "model"
        assert e.value.code == "model_not_found"
