"""audit_generator: white-box audit of a generator's own loop through its sampling calls (issue 35, item 1).

Oracles: an exponential mechanism over references whose per-step bounded range is exactly ε0 (each reference's
utility holds a 0 and a 1), written with torch.multinomial, torch.distributions.Categorical and numpy; the tiny
HF model's warped softmax computed directly; dp-fusion-lib 0.1.0 from the package registry, its own loop.
"""

import math
import threading

import numpy as np
import pytest
import torch

from invink_audit.audit import GeneratorAudit, InterceptionError, Verdict, audit_generator
from invink_audit.audit.whitebox import Claim
from invink_audit.mechanisms import MechanismGuarantee
from invink_audit.mechanisms.base import GuaranteeKind

V, T, EPS0 = 7, 5, 0.8
#: rounding of float64 log-probabilities of magnitude ≤ 10 (the exact checks' own tolerance is 1e-9)
ROUNDING = 1e-12


def _utility(references, prev: int) -> np.ndarray:
    """Σ_i u_i(y | prev), u_i ∈ [0, 1]^V holding a 0 and a 1 (so the range of a replacement's log-ratio is ε0)."""
    total = np.zeros(V)
    for r in references:
        if r is not None:
            total += np.roll(np.linspace(0, 1, V)[np.random.RandomState(1000 + r).permutation(V)], prev)
    return total


def toy_torch(references, rows: int = 2):
    tokens, prev = [], [0] * rows
    gen = torch.Generator().manual_seed(3)
    for _ in range(T):
        logits = torch.tensor(np.stack([EPS0 * _utility(references, p) for p in prev]))
        draw = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(1)
        prev = draw.tolist()
        tokens.append(prev)
    return tokens


def toy_categorical(references):
    tokens, prev = [], 0
    for _ in range(T):
        prev = int(torch.distributions.Categorical(logits=torch.tensor(EPS0 * _utility(references, prev))).sample())
        tokens.append(prev)
    return tokens


def toy_numpy(references, legacy: bool = False):
    rng = np.random.default_rng(11)
    tokens, prev = [], 0
    for _ in range(T):
        w = np.exp(EPS0 * _utility(references, prev))
        p = w / w.sum()
        prev = int(np.random.choice(V, p=p) if legacy else rng.choice(np.arange(V), p=p))
        tokens.append(prev)
    return tokens


def br_claim(epsilon0: float, max_new_tokens: int = T, batch_size: int = 3) -> Claim:
    """A bounded-range claim: ε0 per step, ε0²/8-zCDP per step (Cesar & Rogers 2021, Lemma 3.2), T steps."""
    rho = epsilon0**2 / 8
    g = MechanismGuarantee(GuaranteeKind.A_PRIORI, "toy exponential", epsilon=math.inf, delta=1e-6,
                           max_new_tokens=max_new_tokens, composition="bounded-range", rho_sequence=max_new_tokens * rho,
                           step_epsilon0=epsilon0, step_rho=rho)  # fmt: skip
    return Claim(g, batch_size)


REFS = [1, 2, 3]


@pytest.mark.parametrize(
    "generate, sampler",
    [(toy_torch, "torch.multinomial"), (toy_categorical, "torch.multinomial"),
     (toy_numpy, "numpy Generator.choice"), (lambda r: toy_numpy(r, legacy=True), "numpy.random.choice")],
    ids=["multinomial", "categorical", "numpy-generator", "numpy-legacy"],
)
def test_exponential_mechanism_exact_epsilon(generate, sampler):
    audit = audit_generator(generate, REFS, br_claim(EPS0))
    assert isinstance(audit, GeneratorAudit)
    assert len(audit.calls) == T and {c.sampler for c in audit.calls} == {sampler}
    assert audit.dtypes == ("float64",)
    # the audit finds the true ε0: every neighbour's range is exactly ε0 at every step
    np.testing.assert_allclose(audit.loss_range, EPS0, atol=ROUNDING)
    assert audit.max_abs_log_ratio.max() <= EPS0 + ROUNDING
    assert audit.verdict is Verdict.PASS, audit.reason
    # the released tokens are the generator's own (the interception drew them; replays forced them)
    assert [c.tokens.reshape(-1).tolist() for c in audit.calls] == [np.atleast_1d(t).tolist() for t in audit.output]
    smaller = audit_generator(generate, REFS, br_claim(0.9 * EPS0))
    assert smaller.verdict is Verdict.VIOLATION
    assert smaller.excesses["step bounded range over epsilon0"] == pytest.approx(0.1 * EPS0, abs=1e-9)


def test_batch_rows_are_separate_texts_and_sums_compose():
    audit = audit_generator(toy_torch, REFS, br_claim(EPS0))
    assert audit.calls[0].shape == (2, V, 1)
    assert audit.loss_range.shape == (2 * T, 3) and audit.renyi_forward.shape == (2 * T, 3, 4)
    assert audit.sequence_renyi_forward.shape == (2, 3, 4)
    rows = audit.step_call.reshape(T, 2)
    np.testing.assert_array_equal(rows, np.repeat(np.arange(T), 2).reshape(T, 2))
    per_row = audit.renyi_forward.reshape(T, 2, 3, 4).sum(0)
    np.testing.assert_allclose(audit.sequence_renyi_forward, per_row)
    # each replay is forced to the actual tokens and its distributions are the neighbour's own
    j = 1
    replay = audit.neighbour_calls[j]
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(audit.calls, replay))
    refs = [r if i != j else None for i, r in enumerate(REFS)]
    prev = audit.calls[0].tokens.squeeze(1).tolist()
    expected = torch.log_softmax(torch.tensor(np.stack([EPS0 * _utility(refs, p) for p in prev])), -1)
    torch.testing.assert_close(replay[1].log_probs, expected)


def test_torch_rng_is_restored_and_run_is_reproducible():
    torch.manual_seed(0)
    audit = audit_generator(toy_categorical, REFS, br_claim(EPS0))
    after_audit = torch.rand(3)
    torch.manual_seed(0)
    direct = toy_categorical(REFS)
    after_direct = torch.rand(3)
    assert audit.output == direct
    torch.testing.assert_close(after_audit, after_direct)


def test_no_sampling_call_is_a_clear_error():
    def greedy(references):
        return [int(torch.argmax(torch.tensor(_utility(references, 0))))]

    with pytest.raises(InterceptionError, match=r"no sampling call was intercepted.*1 argmax call\(s\) seen"):
        audit_generator(greedy, REFS, br_claim(EPS0))
    assert torch.multinomial.__module__ == "torch" or torch.multinomial is torch._C._VariableFunctions.multinomial


def test_diverging_replay_names_the_step():
    def shorter_without_reference(references):
        steps = T if None not in references else T - 2
        return [int(torch.multinomial(torch.ones(V), 1)) for _ in range(steps)]

    with pytest.raises(InterceptionError, match=r"neighbour 0: the replay made 3 sampling call\(s\), the actual run 5"):
        audit_generator(shorter_without_reference, REFS, br_claim(EPS0))

    def wider_without_reference(references):
        width = V + (None in references)
        return [int(torch.multinomial(torch.ones(width), 1)) for _ in range(T)]

    with pytest.raises(InterceptionError, match=r"neighbour 0: sampling call 0 differs.*\(1, 8\).*\(1, 7\)"):
        audit_generator(wider_without_reference, REFS, br_claim(EPS0))


def test_patches_restored_and_concurrent_use_refused():
    originals = (torch.multinomial, torch.Tensor.multinomial, np.random.choice, np.random.default_rng, torch.argmax)

    def nested(references):
        audit_generator(toy_torch, REFS, br_claim(EPS0))

    with pytest.raises(RuntimeError, match="another audit_generator run is in progress"):
        audit_generator(nested, REFS, br_claim(EPS0))
    assert (torch.multinomial, torch.Tensor.multinomial, np.random.choice, np.random.default_rng, torch.argmax) == originals

    seen = []

    def with_other_thread(references):
        worker = threading.Thread(target=lambda: seen.append(torch.multinomial(torch.ones(3), 1)))
        worker.start()
        worker.join()
        return toy_categorical(references)

    audit = audit_generator(with_other_thread, REFS, br_claim(EPS0))
    assert len(audit.calls) == T and len(seen) == 4  # the other thread's draws pass through, unrecorded


def test_data_dependent_claim_is_never_a_pass():
    g = MechanismGuarantee(GuaranteeKind.DATA_DEPENDENT, "toy", epsilon=5.0, delta=1e-6, max_new_tokens=T,
                           composition="renyi-filter", renyi_order=2.0, renyi_budget=100.0)  # fmt: skip
    audit = audit_generator(toy_categorical, REFS, Claim(g, 3))
    assert audit.alphas == (2.0,)
    assert audit.verdict is Verdict.INCONCLUSIVE
    tight = audit_generator(toy_categorical, REFS, Claim(MechanismGuarantee(
        GuaranteeKind.DATA_DEPENDENT, "toy", epsilon=5.0, delta=1e-6, max_new_tokens=T, composition="renyi-filter",
        renyi_order=2.0, renyi_budget=1e-3), 3))  # fmt: skip
    assert tight.verdict is Verdict.VIOLATION and "sequence Renyi" in tight.reason


# ---------------------------------------------------------------------------------------------
# transformers' generate(do_sample=True), its warpers included


def _prompt_ids(tokenizer, references):
    text = " | ".join("" if r is None else r for r in references)
    return tokenizer(text, return_tensors="pt").input_ids


def test_hf_generate_records_the_warped_softmax(tiny):
    model, tokenizer = tiny.model, tiny.tokenizer
    references = ["alice lives in paris", "bob likes green tea"]

    def generate(refs):
        out = model.generate(_prompt_ids(tokenizer, refs), do_sample=True, max_new_tokens=3, top_k=20,
                             temperature=0.7, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        return out[0].tolist()

    torch.manual_seed(1)
    audit = audit_generator(generate, references, br_claim(1.0, max_new_tokens=3, batch_size=2))
    assert len(audit.calls) == 3 and audit.dtypes == ("float32",)
    ids = _prompt_ids(tokenizer, references)
    prompt_len = ids.shape[1]
    assert [int(c.tokens) for c in audit.calls] == audit.output[prompt_len:]
    for step in (0, 2):
        prefix = torch.tensor([audit.output[: prompt_len + step]])
        with torch.no_grad():
            scores = model(prefix).logits[0, -1].float() / 0.7
        kth = torch.topk(scores, 20).values[-1]
        expected = torch.softmax(torch.where(scores < kth, -math.inf, scores), -1)
        torch.testing.assert_close(audit.calls[step].log_probs[0].exp(), expected.double(), atol=1e-6, rtol=1e-5)
        assert int((audit.calls[step].log_probs > -math.inf).sum()) == 20
    # a top-k release is not DP: a token in one support and not the other is an infinite loss
    assert audit.verdict is Verdict.VIOLATION and np.isinf(audit.loss_range).any()


# ---------------------------------------------------------------------------------------------
# dp-fusion-lib 0.1.0, its shipped loop, installed from the package registry at test time


# the dp_fusion fixture (tests/conftest.py) installs it from the package registry


PRIVATE_DOC = "John Doe was admitted to St Mary hospital on 3 May with a fracture."
PUBLIC_DOC = "_ was admitted to _ hospital on _ with a fracture."


def _dp_fusion_audit(dp_fusion, tiny, alpha: float, beta: float, aligned: bool, steps: int = 8) -> GeneratorAudit:
    """The user's glue (DP-Fusion's shipped loop). The neighbour (None) is the redacted document. ``aligned``: its
    token path, private and public token ids of equal length (its tagger's form: the private span's tokens replaced
    by the placeholder's id); else ``DPFusion.generate`` with the two documents as text. The claim: the bound its
    λ-search enforces at every step (D_α ≤ αβ, both directions), composed over T steps (a Rényi claim at order α)."""
    dpf, tok = dp_fusion.DPFusion(model=tiny.model, tokenizer=tiny.tokenizer, max_tokens=steps), tiny.tokenizer
    private = tok(PRIVATE_DOC, return_tensors="pt").input_ids[0]
    public = private.clone()
    public[:6] = tok.convert_tokens_to_ids("_")

    def generate(refs):
        if aligned:
            return dpf.generate_from_tokens(public if refs[0] is None else private, public, alpha=alpha, beta=beta)
        return dpf.generate(private_context=refs[0] or PUBLIC_DOC, public_context=PUBLIC_DOC, alpha=alpha, beta=beta)

    g = MechanismGuarantee(GuaranteeKind.DATA_DEPENDENT, "dp-fusion-lib 0.1.0", epsilon=math.inf, delta=1e-5,
                           max_new_tokens=steps, composition="renyi-filter", renyi_order=alpha,
                           renyi_budget=steps * alpha * beta)  # fmt: skip
    torch.manual_seed(0)
    return audit_generator(generate, [PRIVATE_DOC], Claim(g, 1))


def _per_step(audit: GeneratorAudit) -> np.ndarray:
    return np.maximum(audit.renyi_forward, audit.renyi_reverse)[:, 0, 0]


# its torch.amp.autocast("cuda") on a CPU, and its past_key_values= keyword, warn
@pytest.mark.filterwarnings("ignore:.*CUDA is not available:UserWarning", "ignore:.*past_key_values:FutureWarning")
def test_dp_fusion_lib_shipped_loop(dp_fusion, tiny):
    honest = _dp_fusion_audit(dp_fusion, tiny, alpha=2.0, beta=0.5, aligned=True)
    collapse = _dp_fusion_audit(dp_fusion, tiny, alpha=8.0, beta=0.5, aligned=True)
    padded = _dp_fusion_audit(dp_fusion, tiny, alpha=2.0, beta=0.5, aligned=False)
    for audit in (honest, collapse, padded):
        assert {c.sampler for c in audit.calls} == {"torch.multinomial"} and audit.dtypes == ("float32",)
        assert len(audit.calls) == len(audit.output["lambdas"]["PRIVATE"]) + 1  # its first step is never recorded
    # honest: every step's true D_2 within αβ = 1 up to float32 rounding; its own records are our steps 1..T-1
    assert honest.verdict is Verdict.INCONCLUSIVE and _per_step(honest).max() <= 1.0 + 1e-5
    np.testing.assert_allclose(honest.output["divergences"]["PRIVATE"], _per_step(honest)[1:], atol=1e-5)
    # α = 8: every λ is 1 - 2^-20 (its bisection reads NaN as "within the bound"), every divergence it records is
    # NaN, and the released distribution's true D_8 passes αβ = 4 and the composed budget
    assert np.allclose(collapse.output["lambdas"]["PRIVATE"], 1 - 2.0**-20)
    assert np.isnan(collapse.output["divergences"]["PRIVATE"]).all()
    assert _per_step(collapse).max() > 2 * 4.0 and collapse.verdict is Verdict.VIOLATION
    # text contexts of unequal length: its public row is right-padded without an attention mask, so its "public"
    # distribution is not the redacted document's and the release is far from the neighbour's
    assert padded.verdict is Verdict.VIOLATION and _per_step(padded).max() > 4.0
