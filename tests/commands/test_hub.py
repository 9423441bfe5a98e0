"""`hfquant.publishing.hub` against a local stand-in of the Hub (tests/hub_server.py): one commit, every byte, clear errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hub_server import HubServer

from hfquant import HfQuantConfig
from hfquant.conversion.convert import convert
from hfquant.publishing.cards import CARD_MARKER, card_for_convert
from hfquant.publishing.hub import HubError, push_folder

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture()
def hub(monkeypatch):
    """A fresh local Hub; huggingface_hub in this process talks to it, with the LFS protocol instead of Xet."""
    import huggingface_hub.constants as constants

    with HubServer(lifetime=120) as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        # file URLs are built from this template, made from the endpoint when huggingface_hub was imported
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setenv("HF_TOKEN", "hf_test_token")
        yield server


@pytest.fixture(scope="module")
def folder(float_checkpoint, tmp_path_factory):
    """A converted tiny Llama in three shards, with a tokenizer file and a card."""
    out = tmp_path_factory.mktemp("push") / "tiny-int4"
    convert(
        float_checkpoint("llama", torch.bfloat16),
        out,
        HfQuantConfig(bits=4, group_size=32),
        max_shard_size="45KB",  # three shards (the 4-bit default's int8 lm_head made them smaller)
        progress=False,
        before_publish=card_for_convert("tiny-int4", out, base_model=BASE),  # as `hfquant convert --base-model`
    )
    (out / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return out


def _local_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_one_commit_with_every_file(hub, folder):
    info = push_folder(folder, "me/tiny-int4", private=True, commit_message="first")
    assert len(hub.state.commits) == 1
    commit = hub.state.commits[0]
    assert commit["header"]["summary"] == "first" and info.oid == commit["oid"]
    remote = hub.state.files("me/tiny-int4")
    local = _local_files(folder)
    assert sorted(remote) == sorted(local)
    assert len([name for name in remote if name.endswith(".safetensors")]) == 3
    for name, data in local.items():
        if name != "README.md":
            assert remote[name] == data, name
    card = remote["README.md"].decode()  # rendered for the repo: its snippet names the repo
    assert CARD_MARKER in card and 'from_pretrained("me/tiny-int4"' in card and f"base_model: {BASE}" in card
    assert hub.state.repos["me/tiny-int4"]["private"] is True
    paths = [path for _, path in hub.state.requests]
    assert sum(path.startswith("/lfs-upload/") for path in paths) == 3  # the shards went through LFS
    assert sum("/commit/" in path for path in paths) == 1


def test_revision_is_created_as_a_branch(hub, folder):
    push_folder(folder, "me/tiny-int4")
    push_folder(folder, "me/tiny-int4", revision="int4-g32")
    assert [c["branch"] for c in hub.state.commits] == ["main", "int4-g32"]
    assert hub.state.files("me/tiny-int4", "int4-g32")["config.json"] == (folder / "config.json").read_bytes()


def test_handwritten_readme_is_uploaded_unchanged(hub, folder, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for name, data in _local_files(folder).items():
        (copy / name).write_bytes(data)
    (copy / "README.md").write_text("# my own words\n")
    push_folder(copy, "me/own-card")
    assert hub.state.files("me/own-card")["README.md"] == b"# my own words\n"


@pytest.mark.parametrize(
    "kind,status,message",
    [
        ("create", 401, r"create the repo me/x.*401 Unauthorized.*hf auth login"),
        ("commit", 401, r"commit \d+ files to me/x.*401.*HF_TOKEN"),
        ("preupload", 404, r"me/x was not found \(404"),
        ("commit", 500, r"500 \(server error\).*nothing was committed, try again later"),
        ("lfs-upload", 403, r"Error while uploading 'model-0000\d-of-00003.safetensors'.*403 Forbidden.*write access"),
    ],
)
def test_server_errors_become_clear_messages(hub, folder, kind, status, message):
    hub.state.fail[kind] = status
    with pytest.raises(HubError, match=message):
        push_folder(folder, "me/x")
    assert hub.state.commits == []


def test_unreachable_hub(folder):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(HubError, match="could not be reached"):
        push_folder(folder, "me/x", endpoint=url, token="hf_test")


def test_model_push_to_hub_writes_the_hfquant_card(hub, float_checkpoint):
    """push_to_hub of a model quantized on load sends hfquant's card instead of transformers' generic one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        float_checkpoint("llama"), quantization_config=HfQuantConfig(bits=8), device_map="cpu"
    )
    model.push_to_hub("me/on-load-int8", tags=["my-tag"])
    remote = hub.state.files("me/on-load-int8")
    card = remote["README.md"].decode()
    assert CARD_MARKER in card and "model card of a 🤗 transformers model" not in card
    assert "- int8" in card and "- my-tag" in card and "quantization_config=hfquant.HfQuantConfig(" in card
    assert b'"quant_method": "hfquant"' in remote["config.json"]
    assert json.loads(remote["config.json"])["model_type"] == "hfquant"  # refused by transformers without hfquant
    assert len(hub.state.commits) == 1


def test_save_pretrained_with_push_to_hub_pushes_the_marked_save(hub, float_checkpoint, tmp_path):
    """save_pretrained(push_to_hub=True) saves (config.json marked, model_type "hfquant"), then pushes: transformers
    would upload from inside its save, before hfquant marks the config. The repo is named after the folder."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        float_checkpoint("llama"), quantization_config=HfQuantConfig(bits=8), device_map="cpu"
    )
    model.save_pretrained(tmp_path / "saved-int8", push_to_hub=True, commit_message="saved and pushed")
    (repo_id,) = [name for name in hub.state.repos if name.split("/")[-1] == "saved-int8"]
    remote = hub.state.files(repo_id)
    local = json.loads((tmp_path / "saved-int8" / "config.json").read_text())
    assert local["model_type"] == "hfquant" and json.loads(remote["config.json"]) == local
    assert remote["model.safetensors"] == (tmp_path / "saved-int8" / "model.safetensors").read_bytes()
    assert CARD_MARKER in remote["README.md"].decode()
    assert [c["header"]["summary"] for c in hub.state.commits] == ["saved and pushed"]


def test_cli_push_as_a_user(hub, folder):
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_test_token", "HF_HUB_DISABLE_XET": "1"}
    command = [
        sys.executable,
        "-m",
        "hfquant.commands.cli",
        "push",
        str(folder),
        "me/cli",
        "--revision",
        "dev",
        "--commit-message",
        "from the cli",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pushed" in result.stdout and "me/cli" in result.stdout
    assert hub.state.commits[-1]["header"]["summary"] == "from the cli"
    assert (
        hub.state.files("me/cli", "dev")["model.safetensors.index.json"]
        == (folder / "model.safetensors.index.json").read_bytes()
    )


def test_cli_push_error_exit_code_and_message(hub, folder, capsys):
    from hfquant.commands.cli import main

    hub.state.fail["commit"] = 401
    with pytest.raises(SystemExit) as exit_info:
        main(["push", str(folder), "me/cli", "--private"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "hfquant: error: cannot commit" in err and "401" in err and "hf auth login" in err
    assert "Traceback" not in err


def test_server_is_local_bounded_and_stops_by_itself():
    server = HubServer(lifetime=0.3, max_requests=1)
    with server:
        host, port = server.server_address
        assert host == "127.0.0.1"
        import urllib.request
        from urllib.error import HTTPError

        for expected in (404, 429):  # an unknown route, then the request budget is spent
            with pytest.raises(HTTPError) as error:
                urllib.request.urlopen(f"{server.url}/nothing", timeout=5)
            assert error.value.code == expected
        time.sleep(0.8)
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{server.url}/nothing", timeout=2)


def test_push_to_hub_after_dequantize_pushes_the_float_model(hub, float_checkpoint):
    """dequantize() gives a plain float model: push_to_hub is then transformers' own (it raised AttributeError)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        float_checkpoint("llama"), quantization_config=HfQuantConfig(bits=8), device_map="cpu"
    )
    model.dequantize()
    model.push_to_hub("me/dequantized")
    remote = hub.state.files("me/dequantized")
    assert b"quantization_config" not in remote["config.json"]
    assert CARD_MARKER not in remote.get("README.md", b"").decode()
    # transformers asked this server (not huggingface.co, where it waited out 5 retries) for an existing card
    assert ("HEAD", "/me/dequantized/resolve/main/README.md") in hub.state.requests
