"""The mechanism interface (invink_audit.mechanisms) and the engine's generic path.

Oracles: InvisibleInk through the interface is bitwise the engine's own path; for generic
mechanisms the engine's per-step outcome distribution equals the mechanism's step on logits
recomputed one row at a time (no batching, no cache), its public row is bitwise independent of the
private references, and a text's outcomes do not depend on which texts share its forward passes.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from invink_audit.engine import Engine
from invink_audit.mechanism import MechanismConfig, SeededGeneratorWarning, make_generator
from invink_audit.mechanisms import (
    AdaPMixEDConfig,
    AdaPMixEDMechanism,
    AminConfig,
    AminMechanism,
    GuaranteeKind,
    InvisibleInk,
    Mechanism,
    MechanismGuarantee,
    MechanismStep,
    as_mechanism,
)
from invink_audit.mechanisms.base import laplace_cdf_log, laplace_quantile
from invink_audit.models import build_tiny_model
from invink_audit.prompts import encode_request, get_preset

#: float64 model: the engine's batched, cached step against one row at a time without cache (different
#: summation orders: ~1e-12 apart)
FLOAT64_ATOL = 1e-9
#: the Laplace quantile against scipy's ppf: at u = 1e-12 the two closed forms differ by 9e-7 relative;
#: torch.allclose's default rtol (1e-5), spelled out, with its absolute term for values near 0
SCIPY_QUANTILE_RTOL = 1e-5
SCIPY_QUANTILE_ATOL = 1e-9
#: the Laplace log-CDF and log-survival function against scipy: the same expressions, at most one float64
#: ulp apart (measured 1.1e-16); with torch.allclose's default rtol (1e-5), spelled out
SCIPY_LOG_CDF_ATOL = 1e-12
SCIPY_LOG_CDF_RTOL = 1e-5
#: a data-dependent spend is at most its budget: exactly today (the stop rule tests the float64 sum it
#: records), up to a re-association of that sum (~1e-15 relative) allowed
SPEND_ATOL = 1e-12

REFERENCES = [
    ["The food was great and the service was slow.", "", "Mr Smith was admitted to the hospital."],
    ["Discharge instructions: rest.", "Review stars: 5.0", "a"],
    ["", "x", "Business category: Restaurants."],
]


def _generator(seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        return make_generator(seed)


@pytest.fixture(scope="module")
def tiny64():
    return build_tiny_model(seed=1, dtype="float64")


def _requests(model, refs=REFERENCES):
    template = get_preset("generic")
    return [encode_request(model.tokenizer, template, r, key=i) for i, r in enumerate(refs)]


def _amin(batch_size=3, **kw):
    kw.setdefault("posterior_grid", 256)
    return AminMechanism(AminConfig(clip_norm=kw.pop("clip_norm", 2.0), batch_size=batch_size, **kw))


def _adapmixed(batch_size=3, **kw):
    kw.setdefault("screen_samples", 32)
    return AdaPMixEDMechanism(AdaPMixEDConfig(batch_size=batch_size, epsilon=kw.pop("epsilon", 8.0), **kw))


# ------------------------------------------------------------------------------------------------
# the interface


def test_invisibleink_through_the_interface_is_the_engines_own_path(tiny64):
    cfg = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=10, batch_size=3)
    requests = _requests(tiny64)
    a = [f.token_ids for f in Engine(tiny64, cfg).generate(requests, max_new_tokens=6, generator=_generator(3))]
    b = [f.token_ids for f in Engine(tiny64, InvisibleInk(cfg)).generate(requests, max_new_tokens=6, generator=_generator(3))]
    assert a == b
    mech = as_mechanism(cfg)
    assert isinstance(mech, InvisibleInk) and as_mechanism(mech) is mech
    private, public = torch.randn(2, 3, 20, dtype=torch.float64), torch.randn(2, 20, dtype=torch.float64)
    step = mech.step(private, public, torch.zeros(2, 0), torch.zeros(2, 0), exact=True, neighbours=True)
    nb = cfg.neighbour_log_probs(private, public)
    assert torch.equal(step.log_probs, nb.actual) and torch.equal(step.neighbours, nb.neighbours)
    g = mech.guarantee(50, 1e-6)
    assert g.a_priori and g.composition == "bounded-range" and g.step_epsilon0 == cfg.epsilon0
    assert g.rho_sequence == pytest.approx(50 * cfg.rho_token)
    with pytest.raises(ValueError, match="Mechanism or a MechanismConfig"):
        as_mechanism("amin")


def test_guarantee_validation():
    with pytest.raises(ValueError, match="rho_sequence"):
        MechanismGuarantee(GuaranteeKind.A_PRIORI, "m", 1.0, 1e-6, 10, "zcdp")
    with pytest.raises(ValueError, match="renyi_order"):
        MechanismGuarantee(GuaranteeKind.DATA_DEPENDENT, "m", 1.0, 1e-6, 10, "renyi-filter")
    with pytest.raises(ValueError, match="composition"):
        MechanismGuarantee(GuaranteeKind.A_PRIORI, "m", 1.0, 1e-6, 10, "magic", rho_sequence=1.0)
    with pytest.raises(ValueError, match="both step_epsilon0"):
        MechanismGuarantee(GuaranteeKind.A_PRIORI, "m", 1.0, 1e-6, 10, "zcdp", rho_sequence=1.0, step_epsilon0=1.0)
    g = MechanismGuarantee("data-dependent", "m", 2.0, 1e-6, 10, "renyi-filter", renyi_order=15.0, renyi_budget=1.0)
    assert not g.a_priori and "DATA-DEPENDENT" in g.label()


def test_laplace_helpers_match_scipy():
    from scipy import stats

    u = torch.tensor([1e-12, 0.01, 0.3, 0.5, 0.7, 0.99, 1 - 1e-12], dtype=torch.float64)
    expected = torch.tensor(stats.laplace.ppf(u.numpy(), 0.7, 0.3))
    assert torch.allclose(laplace_quantile(u, 0.7, 0.3), expected, rtol=SCIPY_QUANTILE_RTOL, atol=SCIPY_QUANTILE_ATOL)
    x = torch.tensor([-5.0, -0.1, 0.0, 0.2, 4.0], dtype=torch.float64)
    lf, lsf = laplace_cdf_log(x, 0.6)
    tolerance = dict(rtol=SCIPY_LOG_CDF_RTOL, atol=SCIPY_LOG_CDF_ATOL)
    assert torch.allclose(lf, torch.tensor(stats.laplace.logcdf(x.numpy(), scale=0.6)), **tolerance)
    assert torch.allclose(lsf, torch.tensor(stats.laplace.logsf(x.numpy(), scale=0.6)), **tolerance)
    # far tails, where scipy underflows: the closed form log(1/2) - |x|/b
    lf, lsf = laplace_cdf_log(torch.tensor([-800.0, 800.0], dtype=torch.float64), 0.6)
    assert lf[0] == pytest.approx(math.log(0.5) - 800 / 0.6) and lsf[1] == pytest.approx(math.log(0.5) - 800 / 0.6)
    assert lf[1] == 0.0 and lsf[0] == 0.0


class _Broken(Mechanism):
    name = "broken"

    @property
    def batch_size(self):
        return 3

    def step(self, private, public, state, aux, *, exact, neighbours):
        return MechanismStep(torch.zeros(private.shape[0], 5, dtype=torch.float64))

    def guarantee(self, max_new_tokens, delta):  # pragma: no cover - never reached
        raise AssertionError


def test_engine_rejects_a_mechanism_with_wrong_outcome_shapes(tiny64):
    with pytest.raises(ValueError, match="expected"):
        list(Engine(tiny64, _Broken()).generate(_requests(tiny64)[:1], max_new_tokens=2, generator=_generator(0)))
    with pytest.raises(ValueError, match="MechanismConfig or a Mechanism"):
        Engine(tiny64, object())


# ------------------------------------------------------------------------------------------------
# the engine's generic path


def _row_logits(model, request, outcomes_so_far_tokens):
    """Every row's next-token logits recomputed alone (no batching, no cache): public then private."""
    rows = [request.public_ids] + [ids if ids is not None else request.public_ids for ids in request.private_ids]
    out = []
    with torch.inference_mode():
        for ids in rows:
            x = torch.tensor([list(ids) + list(outcomes_so_far_tokens)], dtype=torch.long)
            out.append(model.model(input_ids=x).logits[0, -1])
    return out[0], torch.stack(out[1:])


def test_engine_outcome_distribution_equals_the_mechanism_on_unbatched_logits(tiny64):
    """Teacher-forced by the engine's own draws: at every step the engine's outcome distribution (under R
    and every R'_j) equals the mechanism's step on logits recomputed row by row, given the same state."""
    mech = _amin(max_private_tokens=3)
    requests = _requests(tiny64)
    seen = []

    def observer(step):
        seen.append(
            (step.request_indices.clone(), step.positions.clone(), step.result.log_probs.clone(),
             step.result.neighbours.clone(), step.outcomes.clone())
        )

    texts = {f.request_index: f for f in Engine(tiny64, mech, max_batch_rows=8).generate(
        requests, max_new_tokens=5, generator=_generator(11), observer=observer)}
    vocab = tiny64.vocab_size
    # replay each text alone with its recorded outcomes, on unbatched logits, in exact state
    for i, request in enumerate(requests):
        state = mech.initial_state(torch.zeros(1, 0, dtype=torch.float64), exact=True)
        tokens = []
        for req_idx, pos, lp, nb, outs in seen:
            rows = (req_idx == i).nonzero().reshape(-1)
            if rows.numel() == 0:
                continue
            r = int(rows[0])
            assert int(pos[r]) == len(tokens)
            public, private = _row_logits(tiny64, request, tokens)
            step = mech.step(private[None], public[None], state, torch.zeros(1, 0), exact=True, neighbours=True)
            assert torch.allclose(step.log_probs[0], lp[r], atol=FLOAT64_ATOL, rtol=0)
            assert torch.allclose(step.neighbours[0], nb[r], atol=FLOAT64_ATOL, rtol=0)
            outcome = outs[r : r + 1]
            state, _ = mech.advance(step, state, outcome, torch.zeros(1, 0), exact=True)
            tokens.append(int(outcome) % vocab)
        assert tuple(tokens) == texts[i].token_ids


def test_adapmixed_engine_mixture_equals_unbatched_recomputation(tiny64):
    mech = _adapmixed(epsilon=50.0)
    requests = _requests(tiny64)
    seen = []
    list(Engine(tiny64, mech).generate(requests, max_new_tokens=3, generator=_generator(5),
                                       observer=lambda s: seen.append((s.request_indices.clone(), s.positions.clone(),
                                                                       s.result.log_probs.clone(), s.tokens.clone()))))
    vocab = tiny64.vocab_size
    history = {i: [] for i in range(len(requests))}
    for req_idx, pos, lp, toks in seen:
        for r, i in enumerate(req_idx.tolist()):
            public, private = _row_logits(tiny64, requests[i], history[i])
            aux = torch.full((1, mech.aux_size(exact=True, at_start=False)), 0.5, dtype=torch.float64)
            step = mech.step(private[None], public[None], torch.zeros(1, 1 + mech.batch_size), aux, exact=True, neighbours=False)
            mixed_engine = lp[r, vocab : 2 * vocab]
            mixed_oracle = step.log_probs[0, vocab : 2 * vocab]
            if torch.isfinite(mixed_engine).any():  # the mixed distribution itself, normalised (π differs by its MC draw)
                assert torch.allclose(torch.log_softmax(mixed_engine, -1), torch.log_softmax(mixed_oracle, -1), atol=FLOAT64_ATOL)
            if int(toks[r]) >= 0:
                history[i].append(int(toks[r]))


@pytest.mark.parametrize("make", [_amin, _adapmixed], ids=["amin", "adapmixed"])
def test_generic_public_row_is_independent_of_private_references(tiny64, make):
    mech = make()
    template = get_preset("generic")
    base = ["Alpha beta gamma.", "", "Delta epsilon."]
    changed = ["Something else entirely, much longer than before, with numbers 12345.", "", ""]
    publics = {}
    for name, refs in (("base", base), ("changed", changed)):
        request = encode_request(tiny64.tokenizer, template, refs)
        seen = []

        def force_public(step, seen=seen):  # force the same outcomes (token 7 in mode 0) so prefixes agree
            seen.append(step.public_logits.clone())
            w = torch.full_like(step.result.log_probs, -math.inf)
            w[:, 7] = 0.0
            return w

        list(Engine(tiny64, mech).generate([request], max_new_tokens=4, generator=_generator(1), sampling_rule=force_public))
        publics[name] = torch.stack(seen)
    assert torch.equal(publics["base"], publics["changed"])


@pytest.mark.parametrize("make", [_amin, _adapmixed], ids=["amin", "adapmixed"])
def test_generic_texts_do_not_depend_on_batch_companions(tiny64, make):
    mech = make()
    requests = _requests(tiny64)
    together = {f.request_index: (f.token_ids, f.modes, f.finish_reason)
                for f in Engine(tiny64, mech).generate(requests, max_new_tokens=6, generator=_generator(4))}
    alone = {f.request_index: (f.token_ids, f.modes, f.finish_reason)
             for f in Engine(tiny64, mech, max_batch_rows=1).generate(requests, max_new_tokens=6, generator=_generator(4))}
    assert together == alone


def test_amin_texts_stop_after_r_private_tokens(tiny64):
    mech = _amin(max_private_tokens=2, svt_threshold=-5.0)  # threshold far below: every step is private
    out = list(Engine(tiny64, mech).generate(_requests(tiny64), max_new_tokens=8, generator=_generator(2), stop_at_eos=False))
    for f in out:
        assert f.modes == (1, 1) and f.finish_reason == "budget" and f.spend is None
    mech = _amin(max_private_tokens=2, svt_threshold=50.0)  # far above: public tokens only, free
    out = list(Engine(tiny64, mech).generate(_requests(tiny64), max_new_tokens=5, generator=_generator(2), stop_at_eos=False))
    for f in out:
        assert f.modes == (0,) * 5 and f.finish_reason == "length"


def test_adapmixed_texts_report_their_data_dependent_spend(tiny64):
    mech = _adapmixed(epsilon=3.0)
    out = list(Engine(tiny64, mech).generate(_requests(tiny64), max_new_tokens=8, generator=_generator(2), stop_at_eos=False))
    budget = mech.config.budget
    for f in out:
        assert f.spend is not None and 0.0 <= f.spend <= budget + SPEND_ATOL
        assert f.finish_reason in ("budget", "length")
        assert len(f.modes) == f.num_tokens
