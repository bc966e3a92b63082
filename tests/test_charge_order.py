"""Every check that can fail runs before the ledger is charged: a release that is charged and then cannot
run spends budget on nothing, and no rerun gets it back."""

from __future__ import annotations

import pytest

from accounting import BudgetLedger
from invink_audit.cli import main
from invink_audit.generation import GenerationConfig, generate
from invink_audit.mechanism import MAX_SEED, SeededGeneratorWarning, check_seed, make_generator

REFERENCES = ["The soup was cold.", "Great tacos!", "Slow service.", "Lovely staff."]
CONFIG = GenerationConfig(batch_size=2, max_new_tokens=4, delta=1e-6, epsilon=5.0, top_k=8)


@pytest.fixture
def ledger(tmp_path):
    return BudgetLedger.create(tmp_path / "ledger.json", epsilon=10.0, delta=1e-6)


@pytest.mark.parametrize("seed", [str(2**64), str(2**70), "-1"])
def test_a_seed_out_of_range_is_refused_before_the_charge(seed, tiny_dir, tmp_path, ledger, capsys):
    # probe: --seed >= 2**64 was charged to the ledger, then failed ("Overflow when unpacking long long")
    references = tmp_path / "refs.csv"
    references.write_text("text\n" + "\n".join(REFERENCES) + "\n")
    code = main([
        "generate", "--input", str(references), "--output", str(tmp_path / "out.jsonl"), "--model", str(tiny_dir),
        "--batch-size", "2", "--max-new-tokens", "4", "--epsilon", "5", "--delta", "1e-6", "--top-k", "8",
        "--seed", seed, "--ledger", str(ledger.path), "--no-progress",
    ])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "seed" in err
    assert ledger.status().releases == ()
    assert not (tmp_path / "out.jsonl").exists()


def test_the_largest_seed_runs(tiny):
    assert check_seed(MAX_SEED) == MAX_SEED and check_seed(None) is None
    with pytest.warns(SeededGeneratorWarning):
        result = generate(REFERENCES, CONFIG, model=tiny, seed=MAX_SEED)
    assert len(result.texts) == 2
    for bad in (MAX_SEED + 1, -1, True, 1.0, "3"):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64 - 1\] or None"):
            check_seed(bad)
        with pytest.raises(ValueError, match="seed must be"):
            make_generator(bad)


@pytest.mark.parametrize(
    "suffix", [".sampled.lock", ".sampled", ".state.json", ".pending.json", ".lock"],
    ids=["journal-lock", "journal", "state", "pending", "output-lock"],
)  # (a link at the output itself is followed by design: its bookkeeping files sit beside the link's target)
def test_a_symbolic_link_among_the_outputs_files_is_refused_before_the_charge(suffix, tiny, tmp_path, ledger):
    # probe: a symbolic link at <output>.sampled.lock was refused only after the charge
    output = tmp_path / "out.jsonl"
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / f"out.jsonl{suffix}").symlink_to(target)
    with pytest.raises((ValueError, OSError), match="symbolic link"):
        generate(REFERENCES, CONFIG, model=tiny, output=output, ledger=ledger)
    assert ledger.status().releases == ()
    assert target.read_text() == ""
