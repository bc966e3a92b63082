r"""What a black-box audit audits: one protocol (:class:`BlackBoxTarget`) and the targets this project ships.

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.targets"); docs/guide/auditing.md (§"Black-box targets").
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import importlib
import io
import math
import os
import secrets
from collections.abc import Callable, Sequence

import numpy as np

from accounting.limits import check_count, check_nonnegative, check_positive

__all__ = [
    "BlackBoxTarget", "CallableTarget", "EngineTarget", "HistogramTarget", "ReferencePackageTarget", "SyntheticTarget",
    "as_target",
]


class BlackBoxTarget(abc.ABC):
    """A generator under audit. Subclasses implement :meth:`generate` and may set:

    * ``batched``: ``True`` when :meth:`generate` takes many batches at once (a partition: one pass), ``False``
      when it is called with one batch at a time (progress is reported per batch);
    * ``knows_likelihood``: :meth:`log_likelihood_ratios` gives the exact ratios (gray box);
    * ``slot``: the canary slot the target needs (``None``: any);
    * ``label``: what reports call it.
    """

    batched: bool = True
    knows_likelihood: bool = False
    slot: int | None = None
    label: str = "black-box generator"

    @abc.abstractmethod
    def generate(self, batches: Sequence[Sequence[str]]) -> list[str]:
        """One released text per batch of references (``""``: an emptied, null slot)."""

    def log_likelihood_ratios(self, batches_with_canary: Sequence[Sequence[str]], slot: int) -> np.ndarray:
        r""":math:`\log p(x_i \mid R_i) - \log p(x_i \mid R_i')` of each text of the last :meth:`generate` call:
        ``R_i`` its batch with the canary in ``slot``, ``R_i'`` the same batch with that slot emptied."""
        raise NotImplementedError(f"{type(self).__name__} does not know its texts' likelihoods")

    def texts(self, batches: Sequence[Sequence[str]], progress: Callable[[int, int], None] | None = None) -> list[str]:
        """:meth:`generate` over ``batches`` (at once when ``batched``, else batch by batch, ``progress(done,
        total)`` after each), checked: one string per batch."""
        batches = [list(b) for b in batches]
        if self.batched:
            out = list(self.generate(batches))
        else:
            out = []
            for b in batches:
                out += list(self.generate([b]))
                if progress is not None:
                    progress(len(out), len(batches))
        if len(out) != len(batches) or not all(isinstance(t, str) for t in out):
            raise ValueError(f"the generator must return one string per batch ({len(batches)}); got "
                             f"{[type(t).__name__ for t in out][:3]}… ({len(out)} items)")
        if progress is not None and self.batched:
            progress(len(out), len(batches))
        return out


def as_target(target) -> BlackBoxTarget:
    """A :class:`BlackBoxTarget` as it is; a callable ``references -> text`` as a :class:`CallableTarget`."""
    if isinstance(target, BlackBoxTarget):
        return target
    if callable(target):
        return CallableTarget(target)
    raise ValueError(f"the target must be a BlackBoxTarget or a callable references -> text; got {type(target).__name__}")


class CallableTarget(BlackBoxTarget):
    """A Python callable: ``function(references) -> text`` for one batch (``None`` in a null slot), or with
    ``batched`` ``function(list of batches) -> texts`` for all of them at once (a partition)."""

    def __init__(self, function: Callable, *, batched: bool = False, label: str = "black-box generator") -> None:
        if not callable(function):
            raise ValueError(f"function must be callable; got {type(function).__name__}")
        if not isinstance(batched, bool):
            raise ValueError(f"batched must be a bool; got {batched!r}")
        self.function, self.batched, self.label = function, batched, label

    @classmethod
    def named(cls, name: str, *, batched: bool = False) -> CallableTarget:
        """The callable ``"module:function"`` (imported now; the module must be importable)."""
        module, _, attribute = name.partition(":") if isinstance(name, str) else ("", "", "")
        if not module or not attribute:
            raise ValueError(f"function must be 'module:function'; got {name!r}")
        try:
            function = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"function {name!r} cannot be imported: {err}") from err
        return cls(function, batched=batched, label=f"callable {name}")

    def generate(self, batches):
        batches = [[r or None for r in b] for b in batches]  # the null slot is None, as generate() takes it
        if self.batched:
            return list(self.function(batches))
        return [self.function(b) for b in batches]


class EngineTarget(BlackBoxTarget):
    """Any :class:`~invink_audit.mechanisms.Mechanism` (or an InvisibleInk
    :class:`~invink_audit.mechanism.MechanismConfig`) on this project's engine, a target the auditor can also
    teacher-force: :meth:`generate` releases one text per batch as ``generate`` releases it (cut at the
    prompt's stop strings), :meth:`log_likelihood_ratios` scores them exactly (summed per-step log-probabilities
    of the mechanism's outcomes under the batch and its neighbour). ``model``: a
    :class:`~invink_audit.generation.ModelSpec`, a name or path, or a loaded model (``None``: the embedded
    one). ``generator`` (on the model's device) or ``seed`` fixes the randomness (reproducible audits; OS
    entropy by default: seeded output carries no privacy). ``stop_strings=False`` ends texts at their
    end-of-sequence token or T only."""

    knows_likelihood = True

    def __init__(self, mechanism, *, model=None, max_new_tokens: int, prompt="generic", prompt_fields: dict | None = None,
                 seed: int | None = None, generator=None, stop_strings: bool = True) -> None:
        from invink_audit.engine import Engine
        from invink_audit.generation import ModelSpec
        from invink_audit.mechanism import make_generator
        from invink_audit.mechanisms import as_mechanism
        from invink_audit.models import EMBEDDED_MODEL, load_model
        from invink_audit.prompts import get_preset

        self.mechanism = as_mechanism(mechanism)
        self.max_new_tokens = check_count("max_new_tokens", max_new_tokens)
        load = model if isinstance(model, ModelSpec) else ModelSpec(EMBEDDED_MODEL if model is None else model)
        self.loaded = load_model(load.model, gguf_file=load.gguf_file, device=load.device, dtype=load.dtype)
        self.engine = Engine(self.loaded, self.mechanism, max_batch_rows=load.max_batch_rows)
        template = get_preset(prompt, **(prompt_fields or {}))
        self.template = template if stop_strings else dataclasses.replace(template, stop=())
        self.generator = generator if generator is not None else make_generator(seed, device=self.loaded.device)
        self.drawn: list = []  # the GeneratedText of the last generate call, by batch
        name = "InvisibleInk" if self.mechanism.name == "invisibleink" else self.mechanism.name
        shown = load.model if isinstance(load.model, (str, os.PathLike)) else self.loaded.name
        self.label = f"{name} engine ({shown}, {self.loaded.dtype_choice.dtype})"

    def _requests(self, batches):
        from invink_audit.prompts import encode_request

        return [encode_request(self.loaded.tokenizer, self.template, list(b), key=i) for i, b in enumerate(batches)]

    def generate(self, batches):
        drawn: list = [None] * len(batches)
        for f in self.engine.generate(self._requests(batches), max_new_tokens=self.max_new_tokens, generator=self.generator):
            drawn[f.request_index] = f
        self.drawn = drawn
        return [f.text for f in drawn]

    def outcomes(self, texts) -> list[list[int]]:
        """What the engine forces for ``texts`` (GeneratedText): their tokens, or for a generic mechanism their
        outcomes (``mode·V + token``, and the stop outcome last when the mechanism's stop rule ended the text)."""
        from invink_audit.engine import text_outcomes

        vocab = self.loaded.vocab_size
        return [text_outcomes(t, vocab, self.mechanism.stop_outcome(vocab)) for t in texts]

    def log_likelihood_ratios(self, batches_with_canary, slot: int, forced: Sequence[Sequence[int]] | None = None):
        """The exact ratios (:class:`BlackBoxTarget`) of the last :meth:`generate` call's texts, or of the token ids
        (outcomes) ``forced`` (:class:`~invink_audit.audit.batched.SurrogateScorer`)."""
        import torch

        forced = self.outcomes(self.drawn) if forced is None else forced
        llr = torch.zeros(len(forced), dtype=torch.float64, device=self.loaded.device)

        def observer(step):
            nlp = step.neighbour_log_probs()
            out = (step.outcomes if step.generic else step.tokens)[:, None]
            llr.index_add_(0, step.request_indices, nlp.actual.gather(1, out)[:, 0] - nlp.neighbours[:, slot].gather(1, out)[:, 0])

        with torch.no_grad():
            self.engine.force(self._requests(batches_with_canary), forced, max_new_tokens=self.max_new_tokens,
                              observer=observer)
        return llr.cpu().numpy()


class ReferencePackageTarget(BlackBoxTarget):
    """The reference package ``invink`` (PyPI 0.1.0), one call of ``invink.generate`` per batch.

    ``batch_size`` is our B (private references per text); the package counts the public row in its own batch
    size, so it receives ``B + 1``, with ``num=1``. A batch may hold more than B texts: the package takes the first
    B non-empty ones (with its default ``drop_empty=True`` an emptied slot is skipped and the next reference moves
    into the batch, which is how a neighbour dataset really behaves under that package). Every other keyword goes
    to ``invink.generate`` unchanged, so its defaults (``random_seed=42``, ``max_toks="auto"``,
    ``drop_empty=True``) are audited as shipped unless overridden; ``random_seed=None`` (or ``"fresh"``) draws a
    fresh seed per call. Raises ``ImportError`` when the package (or its dependency pandas) is not importable."""

    batched = False
    label = "reference package invink 0.1.0"

    def __init__(self, model_path: str, *, batch_size: int, dataset_desc: str, epsilon: float, delta: float,
                 **kwargs) -> None:
        importlib.import_module("invink")  # ImportError (the package or pandas missing) is the documented signal
        self.batch_size = check_count("batch_size", batch_size)
        self.arguments = dict(model_name_or_path=model_path, dataset_desc=dataset_desc, epsilon=epsilon, delta=delta,
                              batch_size=self.batch_size + 1, num=1, **kwargs)

    def generate(self, batches):
        import invink

        out = []
        for references in batches:
            args = dict(self.arguments)
            if "random_seed" in args and args["random_seed"] in (None, "fresh"):
                args["random_seed"] = secrets.randbits(31)
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                out.append(invink.generate(txt_list_or_path=list(references), **args).texts[0])
        return out


class SyntheticTarget(BlackBoxTarget):
    """A self-test mechanism (the correct one or a planted bug, :mod:`invink_audit.audit.synthetic`) on a
    logit source: reference ``slot`` of the source is the canary; a batch whose slot holds a text draws from the
    mechanism on R, one whose slot is empty from its neighbour R'_slot (each text its own draw from ``seed``).
    Texts are token ids written as words; the exact log-likelihood ratio of each drawn text is accumulated from
    the same distributions as it is drawn (gray box), the stop at the token budget included (a length only one
    side's budget allows has a ratio of ±∞)."""

    knows_likelihood = True

    def __init__(self, source, mechanism, *, slot: int = 0, seed: int | None = None) -> None:
        import torch

        self.source, self.mechanism, self.slot = source, mechanism, slot
        self.generator = torch.Generator().manual_seed(seed if seed is not None else int(np.random.SeedSequence().entropy % 2**63))
        self.token_ids: list = []
        self._llr = np.zeros(0)

    def generate(self, batches):
        from invink_audit.audit.synthetic import draw_texts

        self.token_ids, self._llr = draw_texts(self.source, self.mechanism, [bool(b[self.slot]) for b in batches],
                                               slot=self.slot, generator=self.generator)
        return [" ".join(str(t) for t in ids) for ids in self.token_ids]

    def log_likelihood_ratios(self, batches_with_canary, slot: int) -> np.ndarray:
        """The ratios of the texts of the last :meth:`generate` call (computed as they were drawn)."""
        if slot != self.slot or len(batches_with_canary) != self._llr.size:
            raise ValueError("log_likelihood_ratios scores the texts of the last generate call, at the source's slot")
        return self._llr.copy()


class HistogramTarget(BlackBoxTarget):
    r"""AugPE's histogram release (:mod:`invink_audit.augpe.histogram`): a batch whose canary slot holds text
    releases the T thresholded noisy histograms :math:`y = \max(h + \sigma Z - H, 0)` of the counts with the canary
    (:func:`~invink_audit.augpe.histogram.noisy_counts`, all trials of an iteration at once), one whose slot is empty
    those of its replace-by-null neighbour. ``data``: :class:`~invink_audit.audit.augpe.CanaryEmbeddings`;
    ``noise_std``, ``iterations``, ``threshold``: what the mechanism runs; ``seed`` fixes the noise (OS entropy by
    default; seeded output carries no privacy). The score is the release's exact log-likelihood ratio, summed over
    bins and iterations: where :math:`y_i > 0` the Gaussian density ratio at :math:`x_i = y_i + H`,
    :math:`((x_i - h'_i)^2 - (x_i - h_i)^2)/(2\sigma^2)`; where the count was clamped (:math:`y_i = 0`) the ratio of
    the clamped masses, :math:`\log\Phi((H - h_i)/\sigma) - \log\Phi((H - h'_i)/\sigma)` (the likelihood of a
    Gaussian censored at H: Tobin 1958, "Estimation of relationships for limited dependent variables",
    Econometrica 26). A threshold on the exact ratio is the most powerful test of the two releases at its
    level (Neyman & Pearson 1933, "On the problem of the most efficient tests of statistical hypotheses").
    """

    knows_likelihood = True
    slot = 0

    def __init__(self, data, *, noise_std: float, iterations: int, threshold: float = 0.0, seed: int | None = None) -> None:
        if not callable(getattr(data, "counts", None)):
            raise ValueError(f"data must be CanaryEmbeddings; got {type(data).__name__}")
        self.noise_std = check_positive("noise_std", noise_std)
        self.iterations = check_count("iterations", iterations)
        self.threshold = check_nonnegative("threshold", threshold)
        self.with_canary, self.without = data.counts(self.iterations)
        self.rng = np.random.default_rng(seed)
        self.released: list[np.ndarray] = []  # of the last generate call, one (trials, k) array per iteration
        self._llr = np.zeros(0)

    @property
    def true_mu(self) -> float:
        r"""The GDP μ of the unclamped releases, :math:`\sqrt{\sum_t\|h_t - h'_t\|^2}/\sigma` (Dong, Roth & Su 2019,
        arXiv:1905.02383, Thm. 2.7 and Cor. 3.3); the clamp at H, post-processing, can only lower it."""
        return math.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(self.with_canary, self.without))) / self.noise_std

    def _log_ratio(self, released: np.ndarray, h: np.ndarray, h_out: np.ndarray) -> np.ndarray:
        from scipy import special

        s, thr = self.noise_std, self.threshold
        x = released + thr
        gauss = ((x - h_out) ** 2 - (x - h) ** 2) / (2.0 * s * s)
        clamped = special.log_ndtr((thr - h) / s) - special.log_ndtr((thr - h_out) / s)
        return np.where(released > 0.0, gauss, clamped[None, :]).sum(axis=1)

    def generate(self, batches):
        """One trial per batch: its T released histograms, kept in :attr:`released` (one (trials, k) array per
        iteration); the text returned for each trial only names it (the batched audit's scores read no text)."""
        from invink_audit.augpe.histogram import noisy_counts

        canary_in = np.array([bool(b[self.slot]) for b in batches])
        llr, self.released = np.zeros(canary_in.size), []
        for h, h_out in zip(self.with_canary, self.without):
            counts = np.where(canary_in[:, None], h[None, :], h_out[None, :])
            released = noisy_counts(counts, self.noise_std, self.threshold, self.rng)  # one row per trial
            self.released.append(released)
            llr += self._log_ratio(released, h.astype(np.float64), h_out.astype(np.float64))
        self._llr = llr
        return [f"augpe histograms, trial {i} of this call" for i in range(canary_in.size)]

    def log_likelihood_ratios(self, batches_with_canary, slot: int) -> np.ndarray:
        """The exact ratios of the releases of the last :meth:`generate` call (computed as they were drawn)."""
        if slot != self.slot or len(batches_with_canary) != self._llr.size:
            raise ValueError("log_likelihood_ratios scores the releases of the last generate call, at slot 0")
        return self._llr.copy()
