"""A model without a chat template: `serve` warns at start and still serves
completions; chat requests and `generate --chat` fail naming `--chat-template FILE`,
which then makes them work."""

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import openai
import pytest
import requests

from conftest import ROOT, _binary, start_server, stop_server

HINT = "--chat-template FILE"
TEMPLATE = ROOT / "tests/fixtures/chat_templates/qwen2_5_tools.jinja"
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def untemplated():
    """The tiny Llama fixture (a Hugging Face directory) without its chat template."""
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        shutil.copytree(ROOT / "tests/fixtures/archs/llama/hf", model)
        config = model / "tokenizer_config.json"
        fields = json.loads(config.read_text())
        del fields["chat_template"]
        config.write_text(json.dumps(fields))
        yield model


def generate(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(_binary()), "generate", *map(str, args), "--max-tokens", "2"],
        capture_output=True, text=True, timeout=300,
    )


def test_serve_warns_at_start_and_serves_completions(untemplated, tmp_path):
    log = tmp_path / "stderr.log"
    with open(log, "w") as stderr:
        srv = start_server("--model", str(untemplated), stderr=stderr)
    try:
        warning = [l for l in log.read_text().splitlines() if "no chat template" in l]
        assert len(warning) == 1 and "--chat-template FILE" in warning[0], log.read_text()
        client = srv.client()
        r = client.completions.create(model=srv.model, prompt="Hi", max_tokens=2)
        assert r.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=srv.model, messages=USER, max_tokens=2)
        assert HINT in e.value.body["message"], e.value.body
        assert e.value.body["param"] == "messages"
        # /tokenize names the same field.
        r = requests.post(srv.base_url + "/tokenize", json={"messages": USER}, headers=srv.headers(), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    finally:
        stop_server(srv)


def test_generate_chat_names_the_option(untemplated):
    out = generate("--model", untemplated, "--chat", "Hi")
    assert out.returncode == 1
    assert HINT in out.stderr, out.stderr
    # Raw prompts run, and the option it names makes chat work.
    assert generate("--model", untemplated, "--prompt", "Hi").returncode == 0
    out = generate("--model", untemplated, "--chat-template", TEMPLATE, "--chat", "Hi")
    assert out.returncode == 0, out.stderr


def test_a_broken_template_in_a_directory_is_a_warning_at_load(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(ROOT / "tests/fixtures/archs/llama/hf", model)
    config = model / "tokenizer_config.json"
    fields = json.loads(config.read_text())
    fields["chat_template"] = "{% for m in messages %}{{ m.content "
    config.write_text(json.dumps(fields))
    out = generate("--model", model, "--prompt", "Hi")
    assert out.returncode == 0, out.stderr
    assert "the chat template cannot be used" in out.stderr, out.stderr
    out = generate("--model", model, "--chat", "Hi")
    assert out.returncode == 1 and "chat template" in out.stderr
