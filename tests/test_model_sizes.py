"""A model configuration's sizes are bounded before any model is built from them (probe F4: a config.json with
``num_hidden_layers`` of 1e30 or 10**12 made ``memory`` grow to 19.8 GB and be killed, and ``generate`` reach
4.6 GB before its charge). Every test here replaces transformers' model builders by a failure, so a check that
let a configuration through would fail the test instead of allocating."""

from __future__ import annotations

import json

import pytest
import torch

from accounting import BudgetLedger
from invink_audit import model_sizes
from invink_audit.cli import EXIT_BAD_INPUT, main
from invink_audit.model_sizes import SIZE_BOUNDS, check_config_file, estimated_parameters, machine_memory_bytes
from invink_audit.models import load_model

REFERENCES = ["The soup was cold.", "Great tacos!", "Slow service.", "Lovely staff."]
# in bounds, but about 1.2e14 parameters: more than any machine's memory
_TOO_LARGE = {"num_hidden_layers": 2048, "hidden_size": 65536, "intermediate_size": 262144, "head_dim": 128,
              "num_attention_heads": 512, "num_key_value_heads": 8}  # fmt: skip
_ABSURD = [
    ({"num_hidden_layers": 10**12}, "num_hidden_layers is 1000000000000, larger than any model's"),
    ({"num_hidden_layers": 1e30}, "num_hidden_layers is 1e+30, larger than any model's"),
    ({"hidden_size": 10**9}, "hidden_size is 1000000000, larger than any model's"),
    ({"intermediate_size": 10**12}, "intermediate_size is 1000000000000"),
    ({"vocab_size": 10**12}, "vocab_size is 1000000000000"),
    ({"max_position_embeddings": 10**15}, "max_position_embeddings is 1000000000000000"),
]


class _Built(Exception):
    """Raised where transformers would have built a model: the check let the configuration through."""


@pytest.fixture
def no_model_is_built(monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise _Built("transformers was asked to build the model")

    for name in ("from_config", "from_pretrained"):
        monkeypatch.setattr(transformers.AutoModelForCausalLM, name, refuse)


def _model_folder(tiny_dir, tmp_path, **sizes):
    """A copy of the tiny model's folder whose config.json has ``sizes``."""
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    for item in tiny_dir.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((tiny_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **sizes}))
    return folder


def _memory(model, capsys):
    rc = main(["memory", "--model", str(model), "--batch-size", "2", "--max-new-tokens", "8", "--prompt-tokens", "16"])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(("sizes", "needle"), _ABSURD)
def test_memory_refuses_a_size_no_model_has_before_building_a_layer(sizes, needle, tiny_dir, tmp_path, capsys,
                                                                     no_model_is_built):  # fmt: skip
    folder = _model_folder(tiny_dir, tmp_path, **sizes)
    rc, out, err = _memory(folder, capsys)
    assert rc == EXIT_BAD_INPUT and out == "", err
    assert err.count("\n") == 1 and f"{str(folder / 'config.json')!r}" in err and needle in err, err


def test_memory_plans_for_a_model_larger_than_this_machine(tiny_dir, tmp_path, capsys):
    # a plan allocates nothing: `memory` plans for the machine the release will run on, not this one
    rc, out, err = _memory(_model_folder(tiny_dir, tmp_path, **_TOO_LARGE), capsys)
    assert rc == 0 and "TiB" in out, err


@pytest.mark.parametrize(("sizes", "needle"), [*_ABSURD, (_TOO_LARGE, "more than this machine's memory")])
def test_load_model_refuses_before_transformers_builds_anything(sizes, needle, tiny_dir, tmp_path, no_model_is_built):
    folder = _model_folder(tiny_dir, tmp_path, **sizes)
    with pytest.raises(ValueError, match="config.json'") as caught:
        load_model(folder, device="cpu", dtype="float32")
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_generate_refuses_before_the_ledger_is_charged(tiny_dir, tmp_path, capsys, no_model_is_built):
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=10.0, delta=1e-6)
    before = ledger.path.read_bytes()
    references = tmp_path / "refs.csv"
    references.write_text("text\n" + "\n".join(REFERENCES) + "\n")
    for sizes in ({"num_hidden_layers": 10**12}, _TOO_LARGE):
        folder = _model_folder(tiny_dir, tmp_path / str(len(sizes)), **sizes)
        rc = main([
            "generate", "--input", str(references), "--output", str(tmp_path / "out.jsonl"), "--model", str(folder),
            "--batch-size", "2", "--max-new-tokens", "4", "--epsilon", "5", "--delta", "1e-6", "--top-k", "8",
            "--ledger", str(ledger.path), "--no-progress",
        ])  # fmt: skip
        err = capsys.readouterr().err
        assert rc == EXIT_BAD_INPUT and err.count("\n") == 1 and str(folder) in err, err
    assert ledger.path.read_bytes() == before and ledger.status().releases == ()
    assert not (tmp_path / "out.jsonl").exists()


def test_a_gguf_file_is_checked_before_it_is_converted(tmp_path, monkeypatch, no_model_is_built):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    monkeypatch.setenv("INVINK_AUDIT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "huge.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [("block_count", 10**9), ("context_length", 64), ("embedding_length", 32),
                       ("feed_forward_length", 64), ("head_count", 4), ("head_count_kv", 2), ("vocab_size", 16)]:
        getattr(writer, f"add_{add}")(value)  # fmt: skip
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}".encode() for i in range(16)])
    writer.add_token_scores([0.0] * 16)
    writer.add_token_types([1] * 16)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"huge\.gguf': num_hidden_layers is 1000000000, larger than any model's"):
        load_model(path, device="cpu", dtype="float32")
    assert not [p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()]  # no entry, no staging left


def test_a_cached_hub_models_config_is_checked(tiny_dir, tmp_path, monkeypatch, capsys, no_model_is_built):
    from huggingface_hub import constants

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--someone--huge"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    config = json.loads((tiny_dir / "config.json").read_text())
    (snapshot / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**12}))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # no local folder of that name
    with pytest.raises(ValueError, match="num_hidden_layers is 1000000000000"):
        load_model("someone/huge", device="cpu", dtype="float32")
    rc, out, err = _memory("someone/huge", capsys)
    assert rc == EXIT_BAD_INPUT and "snapshots" in err and "num_hidden_layers is 1000000000000" in err, err


def test_the_estimate_is_the_models_own_count(tiny):
    # oracle: the parameters transformers builds for the tiny Llama (norm weights are left out of the estimate)
    counted = sum(p.numel() for p in tiny.model.parameters())
    estimate = estimated_parameters(tiny.model.config.to_dict(), "tiny")
    assert 0.99 * counted <= estimate <= counted


def test_bounds_are_inclusive_and_only_numbers_are_bounded():
    for size, (bound, names) in SIZE_BOUNDS.items():
        estimated_parameters({names[-1]: bound}, "edge")  # at the bound: accepted
        with pytest.raises(ValueError, match=f"{names[-1]} is {bound + 1}, larger than any model's"):
            estimated_parameters({names[-1]: bound + 1}, "edge")
        with pytest.raises(ValueError, match=f"edge: {names[0]} is inf"):
            estimated_parameters({names[0]: float("inf")}, "edge")
    # null is the architecture's default; an expert count may be 0 (no experts)
    assert estimated_parameters({"head_dim": None, "intermediate_size": None, "num_local_experts": 0}, "edge") == 0
    with pytest.raises(ValueError, match=r"edge \(text_config\): num_hidden_layers is 1000000000000"):
        estimated_parameters({"model_type": "llava", "text_config": {"num_hidden_layers": 10**12}}, "edge")
    with pytest.raises(ValueError, match="intermediate_size is 2000000"):  # a per-layer list: its largest entry
        estimated_parameters({"intermediate_size": [64, 2 * 10**6]}, "edge")


def test_the_memory_bound_is_this_machines(monkeypatch):
    assert 0 < machine_memory_bytes() <= max(model_sizes.FALLBACK_MEMORY_BYTES, 2**50)
    config = {"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 100}
    parameters = check_config_file(config, dtype_bytes=4, where="small")
    monkeypatch.setattr(model_sizes, "machine_memory_bytes", lambda: 4 * parameters - 1)
    with pytest.raises(ValueError, match=r"^small describes a model of about .* more than this machine's memory"):
        check_config_file(config, dtype_bytes=4, where="small")
    assert check_config_file(config, dtype_bytes=None, where="small") == parameters  # no dtype: sizes only
    assert check_config_file(config, dtype_bytes=torch.bfloat16.itemsize, where="small") == parameters


# probe F4: sizes that are not integers >= 1 crashed `generate` inside transformers (a traceback, exit 1)
_NOT_SIZES = [
    ({"hidden_size": -32}, "hidden_size is -32, not an integer >= 1"),
    ({"num_attention_heads": 4.5}, "num_attention_heads is 4.5, not an integer >= 1"),
    ({"hidden_size": "32"}, 'hidden_size is "32", not an integer >= 1'),
    ({"num_hidden_layers": 0}, "num_hidden_layers is 0, not an integer >= 1"),
    ({"vocab_size": True}, "vocab_size is true, not an integer >= 1"),
    ({"intermediate_size": [64, -1]}, "intermediate_size is -1, not an integer >= 1"),
    ({"num_local_experts": -2}, "num_local_experts is -2, not an integer >= 0"),
]


@pytest.mark.parametrize(("sizes", "needle"), _NOT_SIZES)
def test_a_size_that_is_not_a_positive_integer_is_refused_in_every_path(sizes, needle, tiny_dir, tmp_path, capsys,
                                                                         no_model_is_built):  # fmt: skip
    folder = _model_folder(tiny_dir, tmp_path, **sizes)
    with pytest.raises(ValueError, match="config.json'") as caught:
        load_model(folder, device="cpu", dtype="float32")
    assert needle in str(caught.value) and "\n" not in str(caught.value)
    rc, out, err = _memory(folder, capsys)
    assert rc == EXIT_BAD_INPUT and out == "" and err.count("\n") == 1 and needle in err, err
    with pytest.raises(ValueError, match=r"edge \(text_config\): "):
        estimated_parameters({"text_config": sizes}, "edge")


def _generate(folder, tmp_path, ledger):
    references = tmp_path / "refs.csv"
    references.write_text("text\n" + "\n".join(REFERENCES) + "\n")
    return main([
        "generate", "--input", str(references), "--output", str(tmp_path / "out.jsonl"), "--model", str(folder),
        "--batch-size", "2", "--max-new-tokens", "4", "--epsilon", "5", "--delta", "1e-6", "--top-k", "8",
        "--ledger", str(ledger.path), "--no-progress",
    ])  # fmt: skip


def test_generate_refuses_a_size_that_is_not_a_positive_integer_uncharged(tiny_dir, tmp_path, capsys,
                                                                          no_model_is_built):  # fmt: skip
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=10.0, delta=1e-6)
    before = ledger.path.read_bytes()
    for i, (sizes, needle) in enumerate(_NOT_SIZES[:3]):
        folder = _model_folder(tiny_dir, tmp_path / str(i), **sizes)
        rc = _generate(folder, tmp_path, ledger)
        err = capsys.readouterr().err
        assert rc == EXIT_BAD_INPUT and err.count("\n") == 1 and needle in err and str(folder) in err, err
    assert ledger.path.read_bytes() == before and not (tmp_path / "out.jsonl").exists()


def test_a_config_repeating_a_key_is_refused(tiny_dir, tmp_path, capsys, no_model_is_built):
    # probe F5: `..., "num_hidden_layers": 2, ..., "num_hidden_layers": 1}` ran and was charged
    folder = _model_folder(tiny_dir, tmp_path)
    text = (folder / "config.json").read_text().rstrip()
    (folder / "config.json").write_text(text[:-1] + ', "num_hidden_layers": 1}')
    needle = "repeats the key 'num_hidden_layers'"
    with pytest.raises(ValueError, match="config.json' repeats the key 'num_hidden_layers'"):
        load_model(folder, device="cpu", dtype="float32")
    rc, out, err = _memory(folder, capsys)
    assert rc == EXIT_BAD_INPUT and err.count("\n") == 1 and needle in err, err
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=10.0, delta=1e-6)
    before = ledger.path.read_bytes()
    assert _generate(folder, tmp_path, ledger) == EXIT_BAD_INPUT and needle in capsys.readouterr().err
    assert ledger.path.read_bytes() == before


def test_a_config_larger_than_the_bound_is_refused_unread(tiny_dir, tmp_path, capsys, monkeypatch, no_model_is_built):
    # probe F6: a 300 MB config.json was read whole (1.37 GB peak); the bound is lowered here to keep the test small
    monkeypatch.setattr(model_sizes, "MAX_CONFIG_BYTES", 4096)
    folder = _model_folder(tiny_dir, tmp_path, padding="x" * 5000)
    with pytest.raises(ValueError, match="config.json' is larger than"):
        load_model(folder, device="cpu", dtype="float32")
    rc, out, err = _memory(folder, capsys)
    assert rc == EXIT_BAD_INPUT and err.count("\n") == 1 and "is larger than" in err, err
    monkeypatch.undo()
    assert model_sizes.MAX_CONFIG_BYTES == 16 * 2**20  # real configurations are a few kB
    assert model_sizes.read_config_file(folder / "config.json")["padding"] == "x" * 5000  # within the real bound


def test_a_config_nested_too_deeply_is_one_line(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"a": ' + "[" * 200_000)
    with pytest.raises(ValueError, match="config.json' nests its JSON too deeply"):
        model_sizes.read_config_file(config)
