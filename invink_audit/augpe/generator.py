r"""AugPE (Xie et al. 2024, arXiv:2403.01749, Alg. 1): the paper's API-access baseline, end to end, as the official
implementation runs it (``AI-secure/aug-pe`` at a3f292f; its steps, settings and line numbers, and our public
departures from it: docs/guide/baselines.md, §"AugPE").

**Private data touches only the votes.** The references are embedded once and enter nothing but the DP
nearest-neighbour histograms (:func:`~invink_audit.augpe.histogram.dp_nn_histogram`); every prompt, every paraphrase
and the number of texts are public. The guarantee is the event's (:class:`accounting.AugPEEvent`), stated as every
release states its guarantee (:meth:`AugPEConfig.guarantee`) and charged by the same call as every release
(:func:`invink_audit.generation.charge_release`), once, before anything is generated.

Randomness: one 128-bit key (from the OS, or from a fixed ``seed``: reproducible, **no privacy**), with independent
streams derived from it for the sampling of each round, the style draws and each iteration's noise.
"""

from __future__ import annotations

import dataclasses
import math
import logging
import numbers
import time
import uuid
import warnings
from collections.abc import Sequence

import numpy as np

from accounting import (
    DEFAULT_ACCOUNTANT,
    Accountant,
    AugPEEvent,
    AugPESensitivity,
    BudgetLedger,
    as_accountant,
    plan_augpe_noise_std,
)
from accounting.limits import COUNT_RANGE, RANGES, check_count, check_nonnegative
from accounting.sensitivity import coerce_enum
from invink_audit.augpe.histogram import Selection, dp_nn_histogram, select_candidates
from invink_audit.augpe.prompts import AugPEPrompts, get_augpe_prompts
from invink_audit.mechanism import SeededGeneratorWarning, check_seed, derive_key
from invink_audit.mechanisms.base import GuaranteeKind, MechanismGuarantee
from invink_audit.models import load_model
from invink_audit.prompts import encode_messages, refuse_private_strings

__all__ = ["AugPEConfig", "AugPEResult", "AugPEStats", "SamplingSettings", "augpe_generate"]

_LOG = logging.getLogger(__name__)

#: derived-key labels of the random streams (one key per stream and round: independent, reproducible)
_SEED_ROUND, _VARIATION_ROUND, _STYLE_DRAW, _NOISE, _SELECTION = 0, 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How RANDOM_API and VARIATION_API sample (public generation). Defaults: the official HF API's
    (``apis/hf_api.py`` l. 95–101, 204–216): temperature 1, top-k 50, top-p 0.9, no repeated bigram.
    ``top_k = 0`` and ``no_repeat_ngram_size = 0`` turn those off (transformers' convention)."""

    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.9
    no_repeat_ngram_size: int = 2

    def __post_init__(self) -> None:
        RANGES["temperature"].check("temperature", self.temperature)
        check_count("top_k", self.top_k, minimum=0)
        check_count("no_repeat_ngram_size", self.no_repeat_ngram_size, minimum=0)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p!r}")


@dataclasses.dataclass(frozen=True)
class AugPEConfig:
    """One AugPE release: n = ``num_texts`` texts after T = ``iterations`` histograms over L·n candidates
    (L = ``variations``, the paper's 7). The noise is ``noise_std`` σ (counts; :class:`accounting.AugPEEvent`) or
    planned for ``epsilon`` (:func:`accounting.plan_augpe_noise_std`, safe side); ``delta`` is required in both
    cases (the guarantee is reported at it). ``sensitivity`` ``PAPER`` is the paper's convention and **not a valid
    guarantee** (refused with a ledger). ``allow_all_null``: run even when every reference is empty (a null), as
    :class:`~invink_audit.generation.ReleaseConfig`'s (refused by default: a wrong column, charged for nothing).
    ``event`` is computed here, once: the record of the release."""

    num_texts: int
    iterations: int
    delta: float
    noise_std: float | None = None
    epsilon: float | None = None
    variations: int = 7
    max_new_tokens: int = 64
    sensitivity: AugPESensitivity = AugPESensitivity.REPLACE_BY_NULL
    threshold: float = 0.0
    selection: Selection = Selection.RANK
    prompts: AugPEPrompts | str = "mimic"
    sampling: SamplingSettings = dataclasses.field(default_factory=SamplingSettings)
    batch_size: int = 16
    accountant: Accountant = DEFAULT_ACCOUNTANT
    allow_all_null: bool = False
    event: AugPEEvent = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        for name in ("num_texts", "iterations", "max_new_tokens", "batch_size"):
            COUNT_RANGE.check(name, getattr(self, name))
        if not isinstance(self.allow_all_null, bool):
            raise ValueError(f"allow_all_null must be a bool; got {self.allow_all_null!r}")
        check_count("variations", self.variations, minimum=2)  # L = 1: every candidate selected, none varied
        COUNT_RANGE.check("candidates (num_texts * variations)", self.num_texts * self.variations)
        RANGES["delta"].check("delta", self.delta)
        check_nonnegative("threshold", self.threshold)
        if (self.noise_std is None) == (self.epsilon is None):
            raise ValueError(
                f"give exactly one of noise_std and epsilon; got noise_std={self.noise_std!r}, epsilon={self.epsilon!r}"
            )
        if not isinstance(self.sampling, SamplingSettings):
            raise ValueError(f"sampling must be a SamplingSettings; got {type(self.sampling).__name__}")
        for name, kind in (("sensitivity", AugPESensitivity), ("selection", Selection)):
            object.__setattr__(self, name, coerce_enum(getattr(self, name), kind))
        object.__setattr__(self, "accountant", as_accountant(self.accountant))
        object.__setattr__(self, "prompts", get_augpe_prompts(self.prompts))
        noise_std = self.noise_std
        if noise_std is None:
            noise_std = plan_augpe_noise_std(self.epsilon, self.delta, self.iterations, self.sensitivity, self.accountant)
        object.__setattr__(self, "event", AugPEEvent(noise_std, self.iterations, self.sensitivity))

    def to_json(self) -> dict:
        """The release's public settings, as an output record's ``run`` holds them (σ, Δ and the sensitivity are the
        event's; ``epsilon``: the target σ was planned for, ``None`` when ``noise_std`` was given)."""
        event = self.event
        return {"mechanism": "augpe", "num_texts": self.num_texts, "iterations": self.iterations,
                "variations": self.variations, "noise_std": event.noise_std, "sensitivity": event.sensitivity.value,
                "l2_sensitivity": event.l2_sensitivity, "epsilon": self.epsilon, "delta": self.delta,
                "accountant": self.accountant.value, "threshold": self.threshold, "selection": self.selection.value,
                "max_new_tokens": self.max_new_tokens, "batch_size": self.batch_size,
                "sampling": dataclasses.asdict(self.sampling), "prompts": self.prompts.to_json(),
                "allow_all_null": self.allow_all_null}  # fmt: skip

    def guarantee(self) -> MechanismGuarantee:
        """The release's a-priori guarantee, as every release states one: T Gaussian histograms, ρ-zCDP
        (``composition`` zcdp, ``rho_sequence`` = ρ of the whole release, whatever its texts' lengths), ε at δ from ρ
        under the accountant (:meth:`accounting.AugPEEvent.epsilon`: what a ledger charges); the exact μ-GDP ε of T
        composed Gaussians (never above ε), the accountant and the event among its ``details``. The paper's
        convention is void: its figures are no valid guarantee."""
        event = self.event
        return MechanismGuarantee(
            kind=GuaranteeKind.A_PRIORI, mechanism="augpe", epsilon=event.epsilon(self.delta, self.accountant),
            delta=self.delta, max_new_tokens=self.max_new_tokens, composition="zcdp", rho_sequence=event.rho,
            description=event.describe(), void_reason=None if event.valid else event.describe(),
            details={"gaussian_epsilon": event.gaussian_epsilon(self.delta), "accountant": self.accountant,
                     "event": event.to_json()},
        )  # fmt: skip

    @property
    def num_candidates(self) -> int:
        """L·n: the histogram's bins in every iteration."""
        return self.num_texts * self.variations

    @property
    def num_generations(self) -> int:
        """Full-sequence LLM generations of a release: n seeds, (L − 1)·n paraphrases per round, T rounds."""
        return self.num_texts + self.iterations * (self.variations - 1) * self.num_texts


@dataclasses.dataclass(frozen=True)
class AugPEStats:
    """After-the-fact measurements of a release (public): LLM generations made, wall-clock seconds, the model."""

    generations: int
    seconds: float
    model: str


@dataclasses.dataclass(frozen=True)
class AugPEResult:
    """The released texts (the last iteration's selection), the a-priori ``guarantee`` (void when seeded or the paper's
    convention: its ``void_reason`` says why), each iteration's released noisy histogram (DP outputs: post-processing
    keeps them private), ``stats``, and the ``release_id`` (the one a ledger was charged with, when one was)."""

    texts: tuple[str, ...]
    guarantee: MechanismGuarantee
    noisy_counts: tuple[tuple[float, ...], ...]
    stats: AugPEStats
    release_id: str


# --------------------------------------------------------------------------------------------
# checks that need nothing loaded


def _check_references(references) -> list[str]:
    if isinstance(references, str) or not isinstance(references, Sequence) or not references:
        raise ValueError(f"references must be a non-empty sequence of strings; got {type(references).__name__}")
    for i, text in enumerate(references):
        if not isinstance(text, str):
            raise ValueError(
                f"references[{i}] must be a string (an empty one is a null reference); got {type(text).__name__}"
            )
    return list(references)


def check_not_all_null(references: Sequence[str], allow_all_null: bool) -> None:
    """Refuse references that are all empty (nulls) unless ``allow_all_null``: every vote would go to the empty
    text's nearest candidate, and the ledger would still be charged (the command line checks it before loading)."""
    if not allow_all_null and not any(references):
        raise ValueError(
            f"all {len(references)} references are empty (nulls): every vote would be the empty text's, and the "
            "ledger would still be charged. Check the input column; pass AugPEConfig(allow_all_null=True) "
            "(--allow-all-null) to run anyway"
        )


def _resolve_embedder(embedder):
    """An object with ``embed(texts) -> (n, d) array``: a name (``"mpnet"``, ``"minilm"``) gives an
    :class:`~invink_audit.evaluation.Embedder` that keeps nothing on disk (it loads at its first use)."""
    if isinstance(embedder, str):
        from invink_audit.evaluation.embeddings import Embedder

        return Embedder(embedder, cache=False)
    if not callable(getattr(embedder, "embed", None)):
        raise ValueError(f"embedder must be 'mpnet', 'minilm' or an object with embed(texts); got {embedder!r}")
    return embedder


# --------------------------------------------------------------------------------------------
# the entrance


def augpe_generate(references, config: AugPEConfig, *, model=None, embedder="mpnet", seed: int | None = None,
                   ledger=None, progress=None) -> AugPEResult:  # fmt: skip
    """Run AugPE on ``references`` (private texts; ``""`` is a null reference) and release ``config.num_texts`` texts.

    ``model``: a :class:`~invink_audit.models.LoadedModel`, a name or path for :func:`~invink_audit.models.load_model`,
    or ``None`` for the embedded SmolLM2. ``embedder``: ``"mpnet"`` (the official default, all-mpnet-base-v2),
    ``"minilm"``, or an object with ``embed(texts)`` (an Embedder with a cache keeps the private embeddings on disk).
    ``seed``: a fixed seed makes the run reproducible and its guarantee void (:class:`SeededGeneratorWarning`).
    ``ledger``: an :class:`accounting.BudgetLedger` or its path, charged once with the event's ρ
    (:class:`accounting.ZcdpEvent`, :func:`~invink_audit.generation.charge_release`) after every check and before
    anything is generated or embedded; refused for the paper's convention (no guarantee) and for add-or-remove (it
    does not compose with replace-by-null releases).
    ``progress``: ``progress(phase, done, total)`` (e.g. :func:`invink_audit.cli.phase_progress`'s), told when the
    references are embedded and after each batch of LLM generations (of :attr:`AugPEConfig.num_generations`).
    """
    references = _check_references(references)
    if not isinstance(config, AugPEConfig):
        raise ValueError(f"config must be an AugPEConfig; got {type(config).__name__}")
    check_not_all_null(references, config.allow_all_null)
    refuse_private_strings(config.prompts.public_inputs(), references, f"of AugPE prompts {config.prompts.name!r}")
    check_seed(seed)
    if progress is not None and not callable(progress):
        raise ValueError(f"progress must be callable or None; got {type(progress).__name__}")
    from invink_audit.generation import SEEDED_VOID_REASON, charge_release, release_key

    ledger = BudgetLedger.of(ledger)
    event = config.event.zcdp_event() if ledger is not None else None  # refuses PAPER / add-or-remove
    embed = _resolve_embedder(embedder)
    loaded = load_model(model)
    _check_context(loaded, config)  # a model without a chat template, or too short a context: refused now
    guarantee = config.guarantee()
    if seed is not None:
        reasons = (SEEDED_VOID_REASON, guarantee.void_reason)
        guarantee = dataclasses.replace(guarantee, void_reason="; ".join(r for r in reasons if r))
        warnings.warn(f"AugPE with a fixed seed ({seed}): the output is reproducible and carries no privacy guarantee",
                      SeededGeneratorWarning, stacklevel=2)  # fmt: skip
    release_id = uuid.uuid4().hex
    if ledger is not None:
        charge_release(ledger, event, 1, release_id, "augpe")
    start = time.perf_counter()
    texts, histograms = _evolve(references, config, loaded, embed, release_key(seed), progress or _no_progress)
    stats = AugPEStats(config.num_generations, time.perf_counter() - start, loaded.name)
    return AugPEResult(tuple(texts), guarantee, tuple(histograms), stats, release_id)


def _check_context(loaded, config: AugPEConfig) -> None:
    """Refuse, before the charge, a model whose context cannot hold the longest prompt plus its answer: the longest
    variation prompt (template, longest style, a candidate of at most T tokens) and T generated tokens. A candidate
    re-encoded may take a few more tokens than it was drawn with, so the check keeps a 10% margin on the T's."""
    generation = len(encode_messages(loaded.tokenizer, config.prompts.generation_messages()))
    style = max(config.prompts.styles, key=len)
    variation = len(encode_messages(loaded.tokenizer, config.prompts.variation_messages("", style)))
    needed = max(generation, variation) + math.ceil(2.2 * config.max_new_tokens)
    context = loaded.context_length
    if context is not None and needed > context:
        raise ValueError(
            f"{loaded.name}'s context ({context} tokens) cannot hold AugPE's longest prompt and answer (about {needed} "
            f"tokens: a variation prompt with a candidate of T = {config.max_new_tokens} tokens, then T more): lower "
            "--max-new-tokens or use a model with a longer context"
        )


# --------------------------------------------------------------------------------------------
# the algorithm


def _no_progress(phase: str, done: int, total: int) -> None:
    pass


def _evolve(references: list[str], config: AugPEConfig, loaded, embed, key: int, progress) -> tuple[list[str], list]:
    """The algorithm (docs/guide/baselines.md, §"Correspondence with the official implementation", steps 1–4);
    returns the released texts and each iteration's noisy histogram."""
    n, event = config.num_texts, config.event
    progress("AugPE: embedding the references", 0, 1)
    private = _embeddings(embed, references)  # the one use of the references (step 3b below)
    progress("AugPE: embedding the references", 1, 1)
    done = [0]

    def generated(count: int) -> None:  # public: a count of the generations made, fixed by the config
        done[0] += count
        progress("AugPE: generations", done[0], config.num_generations)

    seed_prompts = [config.prompts.generation_messages()] * n
    selected = _sample(loaded, seed_prompts, config, derive_key(key, _SEED_ROUND), generated)
    selected_vectors = None
    histograms = []
    for t in range(config.iterations):
        round_keys = derive_key(key, _VARIATION_ROUND, t), derive_key(key, _STYLE_DRAW, t)
        candidates = selected + _paraphrase(loaded, selected, config, *round_keys, generated)
        candidates = _grouped(candidates, n, config.variations)
        fresh = [c for i, c in enumerate(candidates) if selected_vectors is None or i % config.variations]
        vectors = _candidate_vectors(embed, fresh, selected_vectors, n, config.variations)
        noise_rng = np.random.default_rng(derive_key(key, _NOISE, t))
        noisy = dp_nn_histogram(private, vectors, event.noise_std, config.threshold, noise_rng)
        chosen = select_candidates(noisy, n, config.selection, np.random.default_rng(derive_key(key, _SELECTION, t)))
        histograms.append(tuple(float(c) for c in noisy))
        selected, selected_vectors = [candidates[i] for i in chosen], vectors[chosen]
        _LOG.info("AugPE iteration %d/%d: %d candidates, %d selected", t + 1, config.iterations, len(candidates), n)
    return selected, histograms


def _grouped(candidates: list[str], n: int, variations: int) -> list[str]:
    """``[s_1..s_n, v_1^1..v_1^{L-1}, v_2^1, ...]`` reordered to ``[s_1, v_1^1..v_1^{L-1}, s_2, ...]``: each parent
    followed by its own paraphrases (``main.py`` l. 134–136), so candidate ``i`` is a kept parent iff ``i % L == 0``."""
    parents, children = candidates[:n], candidates[n:]
    out = []
    for i, parent in enumerate(parents):
        out += [parent, *children[i * (variations - 1) : (i + 1) * (variations - 1)]]
    return out


def _candidate_vectors(embed, fresh: list[str], kept, n: int, variations: int) -> np.ndarray:
    """The candidates' embeddings: the kept parents' rows reused from the last iteration, the rest embedded."""
    new = _embeddings(embed, fresh)
    if kept is None:
        return new
    vectors = np.empty((n * variations, new.shape[1]), dtype=np.float64)
    parent = np.arange(n * variations) % variations == 0
    vectors[parent], vectors[~parent] = kept, new
    return vectors


def _embeddings(embed, texts: list[str]) -> np.ndarray:
    vectors = np.asarray(embed.embed(texts), dtype=np.float64)
    if vectors.ndim != 2 or vectors.shape[0] != len(texts) or not np.all(np.isfinite(vectors)):
        raise ValueError(f"the embedder returned shape {vectors.shape} (or non-finite values) for {len(texts)} texts")
    return vectors


def _paraphrase(loaded, parents: list[str], config: AugPEConfig, sample_key: int, style_key: int, generated) -> list[str]:
    """VARIATION_API: L − 1 paraphrases of each parent, parent-major, each in a uniformly drawn public style
    (``apis/hf_api.py`` l. 248); an empty paraphrase keeps its parent (a public departure from the official code)."""
    styles = config.prompts.styles
    per_parent = config.variations - 1
    draws = np.random.default_rng(style_key).integers(len(styles), size=len(parents) * per_parent)
    messages = [config.prompts.variation_messages(parents[k // per_parent], styles[int(s)]) for k, s in enumerate(draws)]
    texts = _sample(loaded, messages, config, sample_key, generated)
    return [text or parents[k // per_parent] for k, text in enumerate(texts)]


def _sample(loaded, messages: list, config: AugPEConfig, key: int, generated) -> list[str]:
    """One text per chat in ``messages``, sampled with ``model.generate`` in batches of ``config.batch_size`` (left
    padded); batch b draws from torch's generator seeded with ``derive_key(key, b)`` inside ``fork_rng``, so the
    process's global generator is left as it was; ``generated(count)`` after each batch."""
    import torch

    from invink_audit.evaluation.reference_points import sample_left_padded

    prompts = [encode_messages(loaded.tokenizer, m) for m in messages]
    devices = [loaded.device.index or 0] if loaded.device.type == "cuda" else []
    sampling, texts = config.sampling, []
    for b, begin in enumerate(range(0, len(prompts), config.batch_size)):
        batch = prompts[begin : begin + config.batch_size]
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(derive_key(key, b) % 2**63)
            out = sample_left_padded(loaded, batch, max_new_tokens=config.max_new_tokens,
                                     temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                     no_repeat_ngram_size=sampling.no_repeat_ngram_size)  # fmt: skip
        decoded = loaded.tokenizer.batch_decode(out, skip_special_tokens=True)
        texts += [" ".join(text.split()) for text in decoded]
        generated(len(batch))
    return texts
