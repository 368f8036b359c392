"""Model ids: local paths as is, Hub ids from a folder laid out like the Hugging Face cache."""

from __future__ import annotations

import httpx
import pytest
import torch
from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

from qat4.checkpoint import hub
from qat4.checkpoint.compressed_tensors import write_ct
from qat4.checkpoint.hub import resolve
from qat4.checkpoint.loader import load_packed
from qat4.checkpoint.source import AuxFiles
from qat4.checkpoint.synth import synthetic_model
from qat4.cli import main
from qat4.config import TINY
from qat4.errors import Qat4Error

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cached_snapshot(hub_cache, model_id: str):
    """`models--org--name/snapshots/<commit>/` and `refs/main`, as huggingface_hub stores them."""
    repo = hub_cache / ("models--" + model_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return repo / "snapshots" / COMMIT


@pytest.fixture
def offline_home(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf-home" / "hub"


def test_local_path_is_used_as_is(tmp_path, offline_home):
    (tmp_path / "org").mkdir()
    assert resolve(tmp_path / "org") == tmp_path / "org"


def test_model_id_from_the_cache_loads(offline_home):
    snapshot = cached_snapshot(offline_home, "someone/tiny-emb4")
    model = synthetic_model(TINY, seed=1)
    write_ct(snapshot, TINY, model.tensors, AuxFiles(), emb4=True)
    assert resolve("someone/tiny-emb4") == snapshot
    loaded = load_packed("someone/tiny-emb4")
    assert loaded.source == snapshot
    assert torch.equal(loaded.tensors["layers.0.mlp.up_proj"].packed, model.tensors["layers.0.mlp.up_proj"].packed)


def test_hub_cache_variable_wins(tmp_path, offline_home, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    snapshot = cached_snapshot(tmp_path / "elsewhere", "org/name")
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    assert resolve("org/name") == snapshot


def test_offline_and_not_cached(offline_home):
    with pytest.raises(Qat4Error) as info:
        resolve("google/gemma-4-E2B-it")
    message = str(info.value)
    assert message == ("there is no folder or file google/gemma-4-E2B-it, and no model google/gemma-4-E2B-it is in "
                       "the local Hugging Face cache (HF_HUB_OFFLINE is set, so the Hub was not asked)")


@pytest.mark.parametrize("hub_error, hub_part", [
    (RepositoryNotFoundError("404", response=httpx.Response(404, request=httpx.Request("GET", "https://x"))),
     "no model nosuchdir is in the local Hugging Face cache or on the Hub (or it needs a token that is not set)"),
    (ConnectionError("offline"), "no model nosuchdir is in the local Hugging Face cache; the Hub is unreachable"),
])
def test_mistyped_folder_says_there_is_no_such_folder(hub_error, hub_part, offline_home, monkeypatch, capsys):
    """A name that is neither a path nor a cached model: the folder is named missing before the Hub is."""
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def snapshot(model_id, local_only):
        raise LocalEntryNotFoundError("not cached") if local_only else hub_error

    monkeypatch.setattr(hub, "_snapshot", snapshot)
    assert main(["generate", "--model", "nosuchdir", "--prompt", "hi", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qat4 generate: there is no folder or file nosuchdir, and " + hub_part) and err.count("\n") == 1


@pytest.mark.parametrize("path", ["./no/such/folder", "/no/such/folder", "~/no-such-qat4-folder/x/y"])
def test_missing_path_that_is_no_model_id(path, offline_home):
    with pytest.raises(Qat4Error, match="does not exist"):
        resolve(path)
