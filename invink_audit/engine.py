"""The batched decoding engine: many texts × (B+1) rows, one forward pass per token, no padding.

:class:`Engine` runs paper Algorithm 1 (§4) for many texts at once: per text the public row and one
private row per reference (a null reference *is* the public row: replace-by-null adjacency, paper §3),
yielding :class:`GeneratedText` records. It takes a :class:`~invink_audit.mechanism.MechanismConfig` or
any :class:`~invink_audit.mechanisms.Mechanism`; auditors' hooks see every step as a :class:`DecodeStep`.

Design: docs/design/engine.md (its guarantees; §"Inside the code" for ``_Text``, ``_Run``, ``_StepMath``).
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy
import torch

from accounting.limits import check_count
from invink_audit.forward import ForwardStats, RowForward, check_packed_attention, output_layer_split, to_device
from invink_audit.mechanism import (
    ACCUMULATION_DTYPE,
    MechanismConfig,
    NeighbourLogProbs,
    derive_key,
    gumbel_argmax,
    run_key,
    support_log_probs,
    topk_plus_support,
)
from invink_audit.mechanisms.base import Mechanism
from invink_audit.models import LoadedModel
from invink_audit.prompts import TextRequest, reached_stop, release_text
from invink_audit.rows import KV_LAYOUTS, KVPool, KVStore, RowKV, StoredRow, default_kv_layout, default_max_batch_rows

__all__ = [
    "KV_LAYOUTS",
    "DecodeStep",
    "Engine",
    "ForcedTextMismatch",
    "ForwardStats",
    "GeneratedText",
    "GenericDecodeStep",
    "RowForward",
    "default_max_batch_rows",
    "text_outcomes",
]

FINISH_EOS = "eos"
FINISH_LENGTH = "length"
#: the mechanism's stop rule ended the text (a budget of private tokens, or a data-dependent spend)
FINISH_BUDGET = "budget"
#: the text drew one of its template's public stop strings (:attr:`~invink_audit.prompts.TextRequest.stop`)
FINISH_STOP = "stop"
# label of each text's auxiliary stream (mechanisms with their own noise), derived from its stream key
_AUX_LABEL = 0x5D


class ForcedTextMismatch(ValueError):
    """Texts forced through :meth:`Engine.force` that this mechanism and model could not have drawn (a token of
    probability zero, out of range, past the budget, or a text that ends elsewhere)."""


def text_outcomes(text, vocab_size: int, stop_outcome: int | None) -> list[int]:
    """The mechanism's outcomes a released text (a :class:`GeneratedText`, or a record read back with its
    ``token_ids``, ``modes`` and ``finish_reason``) was drawn as, what :meth:`Engine.force` takes: ``mode·V + token``
    (a text of the Top-k+ fast path records no modes: its one mode is 0, its outcomes its tokens), and
    ``stop_outcome`` last when the mechanism's stop rule ended it (``Mechanism.stop_outcome``)."""
    ids = [m * vocab_size + t for t, m in zip(text.token_ids, text.modes or [0] * len(text.token_ids))]
    return ids + [stop_outcome] if stop_outcome is not None and text.finish_reason == FINISH_BUDGET else ids


@dataclasses.dataclass(frozen=True)
class GeneratedText:
    r"""One generated text and its after-the-fact measurements: the one text record, from the engine's
    :meth:`Engine.generate` to a release's :class:`~invink_audit.generation.GenerationResult` and file.

    * ``key``: the request's key (:attr:`~invink_audit.prompts.TextRequest.key`; a release keys each text by
      its batch index, :attr:`batch_index`);
    * ``text``: the released string (:func:`~invink_audit.prompts.release_text`: decoded, cut before the
      request's first public stop string, stripped);
    * ``token_ids``: the sampled tokens, the end-of-sequence token included when one was drawn;
    * ``finish_reason``: ``"eos"``, ``"length"`` (``max_new_tokens`` reached), ``"stop"`` (a public stop
      string) or ``"budget"`` (a generic mechanism's stop rule: Amin et al.'s last private token,
      AdaPMixED's spend);
    * ``topk_plus_size_mean`` / ``_std``: mean and (population) standard deviation of :math:`|V_k^+|`
      over the steps of this text (for a generic mechanism: the size of the outcome support);
    * ``expansion_tokens``: tokens drawn from :math:`V_k^+ \setminus V_k`, i.e. whose public logit is
      below :math:`\ell_k` (0 for the full-vocabulary variant);
    * ``modes``: for a generic :class:`~invink_audit.mechanisms.Mechanism`, each token's mode
      (e.g. 0 public, 1 private for Amin et al.); empty for InvisibleInk (one mode);
    * ``labels``: the batch's labels (label column → value) in a label-conditioned release, else ``None``;
    * ``request_index``: the text's position in the requests of the :meth:`Engine.generate` call that drew
      it (``None`` for a text read back from a file; not compared);
    * ``spend``: a data-dependent mechanism's running spend at the end (its accountant's unit), else
      ``None``. It is a function of the references, so **private**: a release drops it (not compared).
    """

    key: object
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    topk_plus_size_mean: float
    topk_plus_size_std: float
    expansion_tokens: int
    modes: tuple[int, ...] = ()
    labels: Mapping[str, str] | None = None
    request_index: int | None = dataclasses.field(default=None, compare=False)
    spend: float | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def batch_index(self) -> int:
        """The release's batch this text was drawn from (its key)."""
        return int(self.key)


class DecodeStep:
    """What the engine saw and did at one step, for the live texts (``G`` of them, in a fixed order).

    Attributes (all on the model's device; read-only by convention, never modify them):

    * ``request_indices`` (G,) int64: position of each live text in the ``requests`` given to
      :meth:`Engine.generate`;
    * ``positions`` (G,) int64: index ``t`` (0-based) of the token being drawn for each text;
    * ``public_logits`` (G, V) and ``private_logits`` (G, B, V), in the model's dtype (a null
      reference's row is the public row);
    * ``log_probs`` (G, V) float64: the mechanism's distribution (``token_log_probs``);
    * ``sampling_log_probs`` (G, V): what was sampled from (``log_probs`` unless a sampling rule
      replaced it); ``tokens`` (G,) int64: the drawn tokens. Both are ``None`` inside a sampling rule.

    With a generic :class:`~invink_audit.mechanisms.Mechanism` (``generic`` is True), ``log_probs``,
    ``sampling_log_probs`` and the neighbours are over the mechanism's **outcomes** (G, W)
    (``W = num_modes·V``, + 1 for its stop outcome), a sampling rule returns (G, W) log-weights,
    ``outcomes`` (G,) holds the drawn outcomes and ``tokens`` their tokens (−1 for the stop outcome).
    """

    generic = False

    def __init__(self, *, mechanism, request_indices, positions, public_logits, private_logits, log_probs, neighbours):
        self.mechanism: MechanismConfig = mechanism
        self.request_indices: torch.Tensor = request_indices
        self.positions: torch.Tensor = positions
        self.public_logits: torch.Tensor = public_logits
        self.private_logits: torch.Tensor = private_logits
        self.log_probs: torch.Tensor = log_probs
        self.sampling_log_probs: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None
        self._neighbours: NeighbourLogProbs | None = neighbours

    @property
    def num_texts(self) -> int:
        return int(self.request_indices.shape[0])

    def neighbour_log_probs(self) -> NeighbourLogProbs:
        """Log-probabilities under ``R`` (``.actual``) and every neighbour ``R'_j`` (``.neighbours``,
        (G, B, V)), from this step's logits (:func:`invink_audit.mechanism.neighbour_log_probs`)."""
        if self._neighbours is None:
            self._neighbours = self.mechanism.neighbour_log_probs(self.private_logits, self.public_logits)
        return self._neighbours


class GenericDecodeStep(DecodeStep):
    """:class:`DecodeStep` of a generic :class:`~invink_audit.mechanisms.Mechanism` (outcome space, see there)."""

    generic = True

    def __init__(self, *, mechanism, request_indices, positions, public_logits, private_logits, result, vocab_size):
        super().__init__(
            mechanism=mechanism, request_indices=request_indices, positions=positions, public_logits=public_logits,
            private_logits=private_logits, log_probs=result.log_probs, neighbours=None,
        )
        self.result = result
        self.vocab_size = vocab_size
        self.outcomes: torch.Tensor | None = None

    def neighbour_log_probs(self) -> NeighbourLogProbs:
        """Outcome log-probabilities under ``R`` and every ``R'_j`` (the engine computed them: exact state)."""
        if self._neighbours is None:
            if self.result.neighbours is None:
                raise ValueError("neighbour distributions were not computed (generate(..., neighbours=True) or hooks)")
            support = torch.isfinite(self.result.log_probs) | torch.isfinite(self.result.neighbours).any(dim=-2)
            self._neighbours = NeighbourLogProbs(self.result.log_probs, self.result.neighbours, support)
        return self._neighbours


Observer = Callable[[DecodeStep], None]
SamplingRule = Callable[[DecodeStep], torch.Tensor]


# --------------------------------------------------------------------------------------------
# per-text state


class _Stream:
    """One text's uniforms: V float64 draws in [0, 1) per step, keyed by 128 bits (run key, stream id).

    A counter-based Philox generator (numpy) takes the whole 128-bit key (torch's CPU generator would keep
    only 32 bits of a seed, its CUDA one 64, so texts of a large run could share their noise). The host draws
    every text's uniforms of a step and :func:`_upload` moves them to the device in one copy (one operation per
    step, not one per text).
    """

    def __init__(self, key: int):
        self.numpy = numpy.random.Generator(numpy.random.Philox(key=key))

    def uniforms(self, size: int) -> numpy.ndarray:
        return self.numpy.random(size)


def _upload(array: numpy.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` in one copy (pinned and non-blocking on CUDA: no synchronisation)."""
    tensor = torch.from_numpy(array)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor


class _Text:
    """One text of a run: its rows' caches, prefill progress, random stream and what it has drawn.

    ``rows[0]`` is the public row and ``rows[1 + i]`` reference ``i``'s row; a null reference has no
    row (``None``): its logits are the public row's. Rows are prefilled one after the other, in
    chunks; ``states`` keeps each row's output (last hidden state or logits) at the end of its prompt
    until the text draws its first token.
    """

    def __init__(
        self, request_index: int, request: TextRequest, stream_key: int, num_layers: int, reserve: int, device,
        mechanism: Mechanism | None = None, exact: bool = False,
    ):
        self.request_index = request_index
        self.request = request
        prompts = [request.public_ids, *request.private_ids]
        self.prompts: list[tuple[int, ...] | None] = prompts
        self.rows: list[RowKV | None] = [
            None if p is None else RowKV(num_layers, reserve, capacity=len(p) + reserve) for p in prompts
        ]
        self.states: list[torch.Tensor | None] = [None] * len(prompts)
        self.stored: list[StoredRow | None] | None = None  # the rows once decoding (in the run's stores)
        self.held: list[StoredRow] = []  # a pool's slots kept for the null references (their slots stay put)
        self.next_row = 0  # first row whose prefill is not complete
        self.stream = _Stream(stream_key)
        self.tokens: list[int] = []
        self.size_sum = 0.0
        self.size_sq_sum = 0.0
        self.expansion = 0
        # generic mechanisms: the text's state, its auxiliary noise stream and each token's mode
        self.modes: list[int] = []
        self.mech_state: torch.Tensor | None = None
        self.spend: float | None = None
        if mechanism is not None:
            self.aux = _Stream(derive_key(stream_key, _AUX_LABEL))
            n0 = mechanism.aux_size(exact=exact, at_start=True)
            start = _upload(self.aux.uniforms(n0).reshape(1, n0), device)
            self.mech_state = mechanism.initial_state(start, exact=exact)[0]
        self._skip_nulls()

    def _skip_nulls(self) -> None:
        while self.next_row < len(self.rows) and self.rows[self.next_row] is None:
            self.next_row += 1

    @property
    def prefilled(self) -> bool:
        return self.next_row >= len(self.rows)

    @property
    def decoding(self) -> bool:
        """Whether this text's rows take part in the next forward pass (it has drawn a token)."""
        return bool(self.tokens)

    def row_done(self, state: torch.Tensor) -> None:
        self.states[self.next_row] = state
        self.next_row += 1
        self._skip_nulls()

    def finished_text(self, reason: str, tokenizer) -> GeneratedText:
        n = max(len(self.tokens), 1)  # a generic mechanism may stop before its first token
        mean = self.size_sum / n
        variance = max(self.size_sq_sum / n - mean * mean, 0.0)
        return GeneratedText(
            key=self.request.key,
            text=release_text(tokenizer, self.tokens, self.request.stop),
            token_ids=tuple(self.tokens),
            finish_reason=reason,
            topk_plus_size_mean=mean,
            topk_plus_size_std=math.sqrt(variance),
            expansion_tokens=self.expansion,
            modes=tuple(self.modes) if self.mech_state is not None else (),
            request_index=self.request_index,
            spend=self.spend,
        )


# --------------------------------------------------------------------------------------------
# the engine


class Engine:
    """Private decoding of many texts at once with one model and one mechanism configuration.

    ``mechanism``: a :class:`~invink_audit.mechanism.MechanismConfig` (InvisibleInk, the engine's own
    paths) or any :class:`~invink_audit.mechanisms.Mechanism` (docs/design/engine.md, "Inside the code"); a mechanism
    that declares the Top-k+ column capability (:meth:`~invink_audit.mechanisms.Mechanism.topk_plus_columns`,
    InvisibleInk's) runs on the engine's own paths.

    ``max_batch_rows``: rows per decoding forward pass (default :func:`default_max_batch_rows`); at
    most ``max(1, max_batch_rows // (B + 1))`` texts are in progress at once. ``max_prefill_tokens``:
    tokens per prefill forward pass (a longer prompt is prefilled in chunks; default 512); every
    admitted text is prefilled in full in the step that admits it, so when it starts decoding never
    depends on its private prompts' lengths (docs/design/engine.md). ``support_only``: compute private
    logits on the Top-k+ columns only when nothing needs the full rows and the model passes the output-layer probe (docs/design/engine.md);
    ``False`` always computes full logits. ``share_prefill``: prefill each distinct prompt once per
    :meth:`generate` call and copy its cache (bitwise the same; for audits, which repeat prompts).
    ``kv_layout``: one of :data:`KV_LAYOUTS`, where decoding rows' caches live (default ``"pool"`` on CUDA,
    ``"buckets"`` elsewhere; docs/design/engine.md, "On a GPU").
    """

    def __init__(
        self,
        model: LoadedModel,
        mechanism: MechanismConfig,
        *,
        max_batch_rows: int | None = None,
        max_prefill_tokens: int | None = None,
        support_only: bool = True,
        share_prefill: bool = False,
        kv_layout: str | None = None,
    ):
        if not isinstance(model, LoadedModel):
            raise ValueError(f"model must be a LoadedModel (see invink_audit.load_model); got {type(model).__name__}")
        if not isinstance(mechanism, (MechanismConfig, Mechanism)):
            raise ValueError(f"mechanism must be a MechanismConfig or a Mechanism; got {type(mechanism).__name__}")
        if isinstance(mechanism, Mechanism) and mechanism.topk_plus_columns() is not None:
            mechanism = mechanism.topk_plus_columns()  # the capability, not the class, picks the fast path
        generic = isinstance(mechanism, Mechanism)
        rows = default_max_batch_rows(model.device) if max_batch_rows is None else max_batch_rows
        rows = check_count("max_batch_rows", rows)
        prefill = _DEFAULT_PREFILL_TOKENS if max_prefill_tokens is None else max_prefill_tokens
        prefill = check_count("max_prefill_tokens", prefill)
        for name, flag in (("support_only", support_only), ("share_prefill", share_prefill)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool; got {flag!r}")
        kv_layout = default_kv_layout(model.device) if kv_layout is None else kv_layout
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}; got {kv_layout!r}")
        if "logits_to_keep" not in inspect.signature(model.model.forward).parameters:
            raise ValueError(
                f"model {model.name!r} does not accept logits_to_keep; use a recent transformers causal LM"
            )
        self.model = model
        self.mechanism = mechanism
        # a generic mechanism (not InvisibleInk): full logits, per-text state, outcome draws
        self.generic = generic
        self.max_batch_rows = rows
        self.max_prefill_tokens = prefill
        self.share_prefill = share_prefill
        self.kv_layout = kv_layout
        check_packed_attention(model, pool=kv_layout == "pool")
        self.forward = RowForward(model)
        #: the model as (decoder, output layer) when private logits use the Top-k+ columns only, else None
        self.output_split = output_layer_split(model) if support_only and not generic else None
        if self.output_split is not None:
            self.forward.decoder = self.output_split.decoder

    @property
    def support_only(self) -> bool:
        """Whether runs without hooks compute private logits on the Top-k+ columns only."""
        return self.output_split is not None

    @property
    def max_texts(self) -> int:
        """Texts in progress at once: ``max(1, max_batch_rows // (B + 1))``."""
        return max(1, self.max_batch_rows // (self.mechanism.batch_size + 1))

    def kv_bytes(self) -> int:
        """KV-cache bytes held now by the run of this engine's latest :meth:`generate` (0 once it is gone): its
        texts' prefill rows, its stores' buckets, cached prefixes and prompts. A read-only report, e.g. from a
        ``progress`` callback (``invink_audit.capacity`` bounds its peak)."""
        run = getattr(self, "_run", lambda: None)()
        return 0 if run is None else run.kv_bytes()

    def generate(
        self,
        requests: Sequence[TextRequest],
        *,
        max_new_tokens: int,
        generator: torch.Generator,
        observer: Observer | None = None,
        sampling_rule: SamplingRule | None = None,
        neighbours: bool = False,
        stop_at_eos: bool = True,
        progress: Callable[[int], None] | None = None,
        stream_ids: Sequence[int] | None = None,
        key: int | None = None,
        stream_keys: Sequence[int] | None = None,
    ) -> Iterator[GeneratedText]:
        """Generate one text per request; yields texts as they finish (not in request order).

        ``max_new_tokens`` (T) is given by the caller, never derived from the data. ``generator`` is a
        ``torch.Generator`` on the model's device (:func:`invink_audit.mechanism.make_generator`): one
        key is drawn from it per call, and text ``i`` samples from its own stream keyed by that key and
        ``stream_ids[i]`` (default: ``i``), so a text's tokens do not depend on which texts share its
        forward passes. ``key`` (a 128-bit integer) replaces the key drawn from ``generator``: a
        release spread over processes passes its master key and each text's batch index as stream id,
        so a batch's text does not depend on which process drew it. ``stream_keys`` (one 128-bit integer
        per request) gives each text's stream key itself, in place of ``key`` and ``stream_ids``: text
        ``i`` with ``stream_keys[i] = derive_key(key, stream_ids[i])`` draws the same tokens, so a process
        can generate its texts from their own keys without ever holding the key they derive from.
        ``neighbours=True`` computes the neighbour log-probabilities every step (use
        it when the observer or the sampling rule needs them). ``stop_at_eos=False`` ignores
        end-of-sequence tokens (benchmarks). ``progress(n)`` is called after each step with the number
        of tokens drawn.
        """
        requests = list(requests)
        self._check_arguments(requests, max_new_tokens, generator, stream_ids, key, stream_keys)  # now, not at next()
        return self._texts(requests, max_new_tokens, generator, observer, sampling_rule, neighbours, stop_at_eos,
                           progress, stream_ids, key, stream_keys)

    def force(
        self,
        requests: Sequence[TextRequest],
        token_ids: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        observer: Observer,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Teacher forcing: run the engine drawing ``token_ids[i]`` for ``requests[i]``, calling
        ``observer(step)`` at every step (the mechanism's exact distribution, the logits of every row).

        Each text must end where its forced tokens end (at an end-of-sequence token, a stop string of its
        request, the mechanism's stop outcome, or ``max_new_tokens``). With a
        generic :class:`~invink_audit.mechanisms.Mechanism`, ``token_ids[i]`` are the text's *outcomes*
        (``mode·V + token``, the stop outcome last when the mechanism's stop rule ended it). A forced
        token of probability zero under the mechanism, or a text that ends elsewhere, is a
        ``ValueError``: the texts do not match this configuration. ``progress(n)``: as for :meth:`generate`.
        """
        from invink_audit.mechanism import make_generator

        requests = list(requests)
        if len(token_ids) != len(requests):
            raise ValueError(f"token_ids must give one sequence per request ({len(requests)}); got {len(token_ids)}")
        max_new_tokens = check_count("max_new_tokens", max_new_tokens)
        self._check_forced(token_ids, max_new_tokens)
        what, n = ("outcome" if self.generic else "token"), len(requests)
        device = self.model.device
        # as wide as any text can run: a text that does not end where its ids end is forced on (id 0) until
        # the engine ends it, and the length check below reports it (never an index past the tensor)
        longest = max([max_new_tokens + 1, *(len(t) for t in token_ids)])
        forced = torch.zeros((n, longest), dtype=torch.long, device=device)
        for i, ids in enumerate(token_ids):
            forced[i, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)

        def rule(step):
            out = forced[step.request_indices, step.positions]
            if not bool(torch.isfinite(step.log_probs.gather(1, out[:, None])).all()):
                raise ForcedTextMismatch(
                    f"a forced {what} has probability 0 under the mechanism: the texts do not match this configuration"
                )
            return torch.full_like(step.log_probs, -math.inf).scatter_(1, out[:, None], 0.0)

        stop_id = self.mechanism.stop_outcome(self.model.vocab_size) if self.generic else None
        expected = {i: sum(1 for o in t if o != stop_id) for i, t in enumerate(token_ids)}
        texts = self.generate(requests, max_new_tokens=max_new_tokens, generator=make_generator(device=device),
                              observer=observer, sampling_rule=rule, progress=progress)
        with torch.no_grad():
            for f in texts:
                if f.num_tokens != expected[f.request_index]:
                    raise ForcedTextMismatch(
                        f"text {f.request_index} ended after {f.num_tokens} tokens under teacher forcing, "
                        f"but has {expected[f.request_index]}: the texts do not match this configuration"
                    )

    def _check_forced(self, token_ids, max_new_tokens: int) -> None:
        """Each forced sequence is non-empty, in range and not longer than the budget (where it ends is
        checked as the engine ends it: an end-of-sequence token, a stop string, the mechanism's stop rule)."""
        vocab = self.model.vocab_size
        width = self.mechanism.num_outcomes(vocab) if self.generic else vocab
        stop_id = self.mechanism.stop_outcome(vocab) if self.generic else None
        for i, ids in enumerate(token_ids):
            ids = list(ids)
            if not ids or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < width for t in ids):
                raise ForcedTextMismatch(f"token_ids[{i}] must be a non-empty sequence of ids in [0, {width})")
            drawn = sum(1 for t in ids if t != stop_id)
            if drawn > max_new_tokens or stop_id in ids[:-1]:
                raise ForcedTextMismatch(
                    f"token_ids[{i}] has {drawn} tokens, more than max_new_tokens={max_new_tokens} (or the stop "
                    "outcome before its end): the texts do not match this configuration"
                )

    def _texts(self, requests, max_new_tokens, generator, observer, sampling_rule, neighbours, stop_at_eos, progress,
               stream_ids, key, stream_keys) -> Iterator[GeneratedText]:
        """:meth:`generate`'s texts, once its arguments were checked."""
        if not requests:
            return
        if stream_keys is not None:
            keys = [int(k) for k in stream_keys]
        else:
            streams = list(range(len(requests))) if stream_ids is None else [int(s) for s in stream_ids]
            if key is None:
                key = run_key(generator)  # 128 bits; one host transfer per call at most
            keys = [derive_key(key, s) for s in streams]
        hooks = _Hooks(observer, sampling_rule, neighbours)
        run = _Run(self, requests, keys, max_new_tokens, stop_at_eos, exact=hooks.any)
        self._run = weakref.ref(run)  # for kv_bytes
        while not run.done:
            finished, drawn = run.step(hooks)
            if progress is not None:
                progress(drawn)
            yield from finished

    def _check_arguments(self, requests, max_new_tokens, generator, stream_ids, key=None, stream_keys=None) -> None:
        if key is not None and (isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**128):
            raise ValueError("key must be an integer in [0, 2**128) or None")
        if stream_keys is not None:
            if key is not None or stream_ids is not None:
                raise ValueError("give stream_keys (each text's own key) or key and stream_ids, not both")
            keys = list(stream_keys)
            if len(keys) != len(requests):
                raise ValueError(f"stream_keys must give one key per request ({len(requests)}); got {len(keys)}")
            if any(isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < 2**128 for k in keys):
                raise ValueError("stream_keys must be integers in [0, 2**128)")
            if len(set(keys)) != len(keys):
                raise ValueError("stream_keys must be distinct: texts sharing a key would share their noise")
        max_new_tokens = check_count("max_new_tokens", max_new_tokens)
        if not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator; got {type(generator).__name__}")
        if generator.device.type != self.model.device.type:
            raise ValueError(f"generator is on {generator.device} but the model is on {self.model.device}")
        if stream_ids is not None:
            ids = list(stream_ids)
            if len(ids) != len(requests) or len(set(ids)) != len(ids):
                raise ValueError("stream_ids must give one distinct integer per request")
            if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in ids):
                raise ValueError("stream_ids must be non-negative integers")
        limit = self.forward.max_positions
        for i, request in enumerate(requests):
            if not isinstance(request, TextRequest):
                raise ValueError(f"requests[{i}] must be a TextRequest; got {type(request).__name__}")
            if request.batch_size != self.mechanism.batch_size:
                raise ValueError(
                    f"requests[{i}] has {request.batch_size} references but the mechanism is configured for "
                    f"batch_size={self.mechanism.batch_size}"
                )
            longest = max(len(p) for p in (request.public_ids, *request.private_ids) if p is not None)
            if limit is not None and longest + max_new_tokens > limit:
                raise ValueError(
                    f"requests[{i}]: a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                    f"model's {limit} positions"
                )


_DEFAULT_PREFILL_TOKENS = 512
# shortest template prefix worth sharing between private rows
_MIN_PREFIX = 4


@dataclasses.dataclass(frozen=True)
class _Hooks:
    observer: Observer | None
    sampling_rule: SamplingRule | None
    neighbours: bool

    @property
    def any(self) -> bool:
        return self.observer is not None or self.sampling_rule is not None or self.neighbours


class _Run:
    """State of one :meth:`Engine.generate` call: waiting requests and the texts in progress (slots).

    Shapes never depend on private data: a decoding forward pass always has ``B + 1`` rows per text in
    progress (a text still being prefilled, or a null reference, contributes placeholder rows), and
    texts enter and leave only when texts finish; so no private reference can change the public rows'
    arithmetic, and a text's rows never see another row (:mod:`invink_audit.rows`).
    """

    def __init__(self, engine: Engine, requests, keys: list[int], max_new_tokens: int, stop_at_eos: bool, *, exact: bool = False):
        self.engine = engine
        self.exact = exact  # generic mechanisms: exact state (hooks) or sampled state
        self.requests = requests
        self.keys = keys  # each request's 128-bit stream key
        self.max_new_tokens = max_new_tokens
        self.stop_at_eos = stop_at_eos
        self.device = engine.model.device
        self.pending = collections.deque(range(len(requests)))
        self.texts: list[_Text] = []
        # prefilled prompts shared by the run's texts (share_prefill), keyed by (hidden states?, prompt)
        self.shared: dict = {}
        self.prefixes: dict[tuple[int, ...], RowKV] = {}  # template prefixes' caches (public tokens)
        self.eos = frozenset(engine.model.eos_token_ids)
        self.store = self._store(engine, len(requests))
        self.width = None  # columns gathered for the private rows (Top-k+ path), grown on overflow

    @staticmethod
    def _store(engine: Engine, num_requests: int) -> KVStore | KVPool:
        """The decoding rows' caches, public rows inserted as such. Buckets: each public row in a bucket of its
        own (its attention's shapes depend on nothing else, on any device). A pool: sized from public information
        (texts in progress × (B + 1)); a public row's result is its own computation alone at its own width,
        whether the pool's shape is tile invariant or not (:class:`~invink_audit.rows.KVPool`)."""
        if engine.kv_layout == "buckets":
            return engine.forward.new_store()
        texts = min(num_requests, engine.max_texts)
        return engine.forward.new_pool(texts * (engine.mechanism.batch_size + 1))

    @property
    def done(self) -> bool:
        return not self.pending and not self.texts

    def kv_bytes(self) -> int:
        """Bytes of every KV buffer this run holds now (:meth:`Engine.kv_bytes`)."""
        rows = [r for t in self.texts for r in t.rows if r is not None]
        rows += [*self.prefixes.values(), *(row for row, _ in self.shared.values())]
        return self.store.allocated_bytes() + sum(row.allocated_bytes() for row in rows)

    # ---------------------------------------------------------------- admission and prefill

    def _admit(self) -> None:
        while self.pending and len(self.texts) < self.engine.max_texts:
            index = self.pending.popleft()
            generic = self.engine.mechanism if self.engine.generic else None
            self.texts.append(
                _Text(index, self.requests[index], self.keys[index], self.engine.forward.num_layers,
                      self.max_new_tokens, self.device, generic, self.exact)
            )

    def _prefill(self, hidden: bool) -> None:
        """Prefill every admitted text's rows completely, in chunks of ``max_prefill_tokens``.

        No per-step token budget: with one, a text whose private references are long would start
        decoding steps later than its neighbour's, so which texts share a decoding pass (the public
        rows' arithmetic), the order texts finish in and every later admission would depend on private
        lengths (replace-by-null would change them). Here a text admitted in a step draws its first
        token in that step, whatever its prompts are."""
        chunk = self.engine.max_prefill_tokens
        for text in self.texts:
            while not text.prefilled:
                self._prefill_chunk(text, chunk, hidden)

    def _prefill_chunk(self, text: _Text, chunk: int, hidden: bool) -> int:
        index = text.next_row
        row, prompt = text.rows[index], text.prompts[index]
        key = (hidden, prompt)
        if self.engine.share_prefill and row.length == 0 and key in self.shared:
            cached, state = self.shared[key]
            text.rows[index] = cached.copy(self.max_new_tokens)
            text.row_done(state)
            return 0
        prefix = text.request.private_prefix
        if index > 0 and row.length == 0 and _MIN_PREFIX <= len(prefix) < len(prompt) and prompt[: len(prefix)] == prefix:
            # the template's part before the reference: computed once per run, copied (public tokens only)
            text.rows[index] = row = self._prefix_row(prefix, hidden).copy(0, capacity=len(prompt) + self.max_new_tokens)
            return 0
        part = prompt[row.length : row.length + chunk]
        state = self.engine.forward.prefill(row, part, hidden=hidden)
        if row.length == len(prompt):
            if self.engine.share_prefill:
                self.shared[key] = (row.copy(0), state)
            text.row_done(state)
        return len(part)

    def _prefix_row(self, prefix: tuple[int, ...], hidden: bool) -> RowKV:
        if prefix not in self.prefixes:
            row = self.engine.forward.new_row(0)
            for start in range(0, len(prefix), self.engine.max_prefill_tokens):
                self.engine.forward.prefill(row, prefix[start : start + self.engine.max_prefill_tokens], hidden=hidden)
            self.prefixes[prefix] = row
        return self.prefixes[prefix]

    # ---------------------------------------------------------------- one step

    def step(self, hooks: _Hooks) -> tuple[list[GeneratedText], int]:
        """Admit and prefill, then one token for every text that is ready; returns (finished, drawn)."""
        mechanism = self.engine.mechanism
        hidden = self.engine.support_only and not hooks.any
        self._admit()
        self._prefill(hidden)
        ready = [s for s, t in enumerate(self.texts) if t.prefilled]
        if not ready:
            return [], 0
        features = self._forward(hidden)
        rows = _slot_rows(features, self.texts, ready, mechanism.batch_size)
        arithmetic = _OutcomeMath(self.engine, self) if self.engine.generic else _StepMath(self.engine, self, hidden)
        return self._record(ready, arithmetic.draw(rows, ready, hooks))

    def _forward(self, hidden: bool) -> torch.Tensor | None:
        """The decoding forward pass over every slot's B + 1 rows (placeholders where a row is not decoding)."""
        if not any(t.decoding for t in self.texts):
            return None
        rows, ids = [], []
        for text in self.texts:
            if text.decoding and text.stored is None:  # drew its first token: its rows start decoding
                placed = [self.store.reserve() if r is None else self.store.insert(r, public=j == 0)
                          for j, r in enumerate(text.rows)]
                text.stored = [None if r is None else p for r, p in zip(text.rows, placed)]
                text.held = [p for r, p in zip(text.rows, placed) if r is None and p is not None]
                text.rows = [None] * len(text.rows)  # the prefill buffers are no longer needed
            last = text.tokens[-1] if text.decoding else 0
            for row in text.stored or [None] * len(text.prompts):
                rows.append(row)
                ids.append(last if row is not None else 0)
        return self.engine.forward.decode(rows, ids, hidden=hidden)

    def _finish_reason(self, text: _Text, token: int) -> str | None:
        """Why ``text`` ends after drawing ``token`` (``None``: it goes on). Released tokens and public
        settings only: EOS, the template's public stop strings, or its ``max_new_tokens``-th token."""
        if self.stop_at_eos and token in self.eos:
            return FINISH_EOS
        if text.request.stop and reached_stop(self.engine.model.tokenizer, text.tokens, text.request.stop):
            return FINISH_STOP
        if len(text.tokens) >= self.max_new_tokens:
            return FINISH_LENGTH
        return None

    def _record(self, ready: list[int], draws: list[_Draw]) -> tuple[list[GeneratedText], int]:
        """Record each ready text's draw (its token and mode, or the stop outcome of a mechanism's stop rule);
        the texts that finish leave the run. Returns (finished, tokens drawn)."""
        vocab = self.engine.model.vocab_size
        stop_outcome = self.engine.mechanism.stop_outcome(vocab) if self.engine.generic else None
        finished, gone, drawn = [], set(), 0
        for slot, draw in zip(ready, draws):
            text = self.texts[slot]
            text.states = [None] * len(text.states)
            if stop_outcome is not None and draw.outcome == stop_outcome:
                finished.append(text.finished_text(FINISH_BUDGET, self.engine.model.tokenizer))  # ended by its stop rule, no token
                gone.add(slot)
                continue
            token = draw.outcome % vocab
            drawn += 1
            text.tokens.append(token)
            if self.engine.generic:
                text.modes.append(draw.outcome // vocab)
            text.size_sum += draw.size
            text.size_sq_sum += draw.size * draw.size
            text.expansion += draw.outside
            reason = self._finish_reason(text, token)
            if reason is None and draw.stop_after:
                reason = FINISH_BUDGET
            if reason is not None:
                finished.append(text.finished_text(reason, self.engine.model.tokenizer))
                gone.add(slot)
        for slot in gone:
            for row in [*(self.texts[slot].stored or ()), *self.texts[slot].held]:
                if row is not None:
                    row.store.remove(row)
        if gone:
            self.texts = [t for s, t in enumerate(self.texts) if s not in gone]
        return finished, drawn


@dataclasses.dataclass(frozen=True)
class _Draw:
    """One text's draw of one step, for :meth:`_Run._record`: the outcome (InvisibleInk: the token; a generic
    mechanism: mode · V + token, or its stop outcome), the support's size, whether the token fell outside the
    public top-k (InvisibleInk's expansion) and whether the mechanism's stop rule ends the text after it."""

    outcome: int
    size: float
    outside: int = 0
    stop_after: bool = False


def _slot_rows(features, texts: list[_Text], ready: list[int], batch_size: int) -> torch.Tensor:
    """(G, B + 1, F): every slot's public row then its B private rows, from this step's outputs
    (decoding texts) or from their prefill (texts drawing their first token). A null reference's entry
    is a stand-in (the public row); a slot that is not ready repeats the first ready slot, so the
    step's arithmetic has one row per slot whatever the texts' prefill progress."""
    per_slot = batch_size + 1
    parts = {}
    for slot in ready:
        text = texts[slot]
        if text.decoding:
            parts[slot] = features[slot * per_slot : (slot + 1) * per_slot]
        else:
            public = text.states[0]
            parts[slot] = torch.stack([public if s is None else s for s in text.states])
    filler = parts[ready[0]]
    return torch.stack([parts.get(slot, filler) for slot in range(len(texts))])


# --------------------------------------------------------------------------------------------
# the step's arithmetic: the mechanism and the draw, on the device, one host transfer

_OK, _BAD_PUBLIC, _BAD_PRIVATE, _NAN, _POSINF, _EMPTY = range(6)
_ERRORS = {
    _BAD_PUBLIC: "public_logits must be finite",
    _BAD_PRIVATE: "private_logits must be finite",
    _NAN: "log_probs must not contain NaN",
    _POSINF: "log_probs must not contain +inf",
    _EMPTY: "every row of log_probs must have at least one finite entry (a non-empty support)",
}


def _weights_code(weights: torch.Tensor) -> torch.Tensor:
    """Per row: _NAN, _POSINF or _EMPTY when the sampling weights cannot be sampled from, else _OK."""
    row_max = weights.amax(dim=-1)
    code = torch.where(torch.isneginf(row_max), _EMPTY, _OK)
    code = torch.where(torch.isposinf(row_max), _POSINF, code)
    return torch.where(torch.isnan(row_max), _NAN, code)


def _support_log_probs(head, mechanism, public, support, private_states, null, index):
    """The mechanism's log-probabilities on the columns ``index`` (G, m) (all columns when None) and the
    private logits they came from: the output layer applied to the private rows' hidden states on those
    columns only (``head=None``: the rows are logits already), a null reference's row replaced by the
    public row (bitwise). Returns
    (log-probs (G, m), private logits (G, B, m))."""
    if index is None:
        inside, compact = support, public
        private = private_states if head is None else head(private_states)
    else:
        inside, compact = support.gather(-1, index), public.gather(-1, index)
        weight = head.weight.index_select(0, index.reshape(-1)).view(*index.shape, -1)
        private = torch.bmm(private_states, weight.transpose(1, 2))
        if head.bias is not None:
            private = private + head.bias[index].unsqueeze(-2)
    # a null reference's row IS the public row: its logits are the public logits, bitwise
    private = torch.where(null.unsqueeze(-1), compact.unsqueeze(-2), private)
    log_probs = support_log_probs(
        private, compact.to(ACCUMULATION_DTYPE), inside, clip_norm=mechanism.clip_norm,
        temperature=mechanism.temperature,
    )
    return log_probs, private


class _StepMath:
    """One step's mechanism and draw for the texts in progress (``G`` slots), all on the device.

    The rows of every slot enter the arithmetic (so its shapes do not depend on which texts are
    ready); only ready texts draw, each from its own stream. Everything the host needs (tokens, set
    sizes, expansion flags, error codes) comes back in one transfer.
    """

    def __init__(self, engine: Engine, run: _Run, hidden: bool):
        self.engine, self.run, self.hidden = engine, run, hidden
        self.mechanism = engine.mechanism
        self.vocab_size = engine.model.vocab_size

    def draw(self, rows: torch.Tensor, ready: list[int], hooks: _Hooks) -> list[_Draw]:
        """The ready slots' tokens with their Top-k+ set sizes and expansion flags, in ``ready`` order."""
        texts = [self.run.texts[s] for s in ready]
        device = rows.device
        null = to_device([[p is None for p in t.prompts[1:]] for t in self.run.texts], device, torch.bool)
        uniforms = numpy.zeros((len(self.run.texts), self.vocab_size))
        for slot, text in zip(ready, texts):
            uniforms[slot] = text.stream.uniforms(self.vocab_size)
        uniforms = _upload(uniforms, device)
        if not hooks.any:
            values = self._draw_support(rows[:, 0], rows[:, 1:], null, uniforms)
            values = [values[s] for s in ready]
        else:
            take = to_device(ready, device)
            values = self._draw_full(rows, null, uniforms, take, texts, hooks)
        return self._unpack(values, texts)

    # ------------------------------------------------------------ Top-k+ columns only

    def _draw_support(self, public_states, private_states, null, uniforms) -> list[list[int]]:
        """The hot path (no hooks): Top-k+ columns only when the rows are hidden states, else full rows."""
        head = self.engine.output_split.head if self.hidden else None
        public = public_states if head is None else head(public_states)
        mechanism = self.mechanism
        support = topk_plus_support(
            public.to(ACCUMULATION_DTYPE), mechanism.top_k, mechanism.clip_norm, mechanism.batch_size
        )
        full = head is None or mechanism.top_k is None or mechanism.top_k >= self.vocab_size
        while True:
            width = self.vocab_size if full else (self.run.width or min(self.vocab_size, max(4 * mechanism.top_k, 256)))
            report = self._support_report(head, public, support, private_states, null, uniforms.clone(), width)
            values = report.tolist()  # the step's one host synchronisation
            largest = max(v[1] for v in values)
            if largest <= width:
                return values
            # rare: a Top-k+ set wider than the gathered columns; redo the step with the same uniforms
            self.run.width = min(self.vocab_size, 1 << (largest - 1).bit_length())

    def _support_report(self, head, public, support, private_states, null, uniforms, width) -> torch.Tensor:
        """(G, 4) int64: token, |V_k+|, drawn below the k-th public logit, error code."""
        public64, top_k = public.to(ACCUMULATION_DTYPE), self.mechanism.top_k
        index, kth = None, None
        if width < self.vocab_size:
            top = torch.topk(public64, width, dim=-1, sorted=True)
            index, kth = top.indices, top.values[:, top_k - 1]
        elif top_k is not None and top_k < self.vocab_size:
            kth = torch.topk(public64, top_k, dim=-1).values[:, -1]
        log_probs, private = _support_log_probs(head, self.mechanism, public, support, private_states, null, index)
        choice = gumbel_argmax(log_probs, uniforms if index is None else uniforms.gather(-1, index))
        tokens = choice if index is None else index.gather(-1, choice[:, None])[:, 0]
        outside = torch.zeros_like(tokens) if kth is None else (public64.gather(-1, tokens[:, None])[:, 0] < kth).long()
        code = torch.where(torch.isfinite(public).all(dim=-1), _OK, _BAD_PUBLIC)
        code = torch.where(torch.isfinite(private).all(dim=-1).all(dim=-1), code, _BAD_PRIVATE)
        code = torch.where(code == _OK, _weights_code(log_probs), code)
        return torch.stack([tokens, support.sum(dim=-1), outside, code], dim=-1)

    # ------------------------------------------------------------ full logits (hooks, or no split)

    def _draw_full(self, rows, null, uniforms, take, texts, hooks: _Hooks) -> list[list[int]]:
        """Full logits for every slot; the mechanism, hooks and draw for the ready ones (``take``)."""
        public = rows[:, 0].index_select(0, take)
        private = torch.where(null.unsqueeze(-1), rows[:, :1], rows[:, 1:]).index_select(0, take)
        uniforms = uniforms.index_select(0, take)
        mechanism = self.mechanism
        neighbour_result = None
        if hooks.neighbours:
            neighbour_result = mechanism.neighbour_log_probs(private, public)
            log_probs = neighbour_result.actual
        else:
            log_probs = mechanism.token_log_probs(private, public)
        step = None
        if hooks.observer is not None or hooks.sampling_rule is not None:
            step = DecodeStep(
                mechanism=mechanism,
                request_indices=torch.tensor([t.request_index for t in texts], device=public.device),
                positions=torch.tensor([len(t.tokens) for t in texts], device=public.device),
                public_logits=public,
                private_logits=private,
                log_probs=log_probs,
                neighbours=neighbour_result,
            )
        sampling = _apply_sampling_rule(hooks, step, log_probs)
        code = _weights_code(sampling)
        tokens = gumbel_argmax(sampling.to(ACCUMULATION_DTYPE), uniforms)
        if step is not None:
            step.sampling_log_probs, step.tokens = sampling, tokens
            if hooks.observer is not None:
                hooks.observer(step)
        sizes = torch.isfinite(log_probs).sum(dim=-1)
        outside = torch.zeros_like(tokens)
        top_k = mechanism.top_k
        if top_k is not None and top_k < self.vocab_size:
            kth = torch.topk(public, top_k, dim=-1).values[:, -1]
            outside = (public.gather(1, tokens[:, None])[:, 0] < kth).long()
        return torch.stack([tokens, sizes, outside, code], dim=-1).tolist()

    @staticmethod
    def _unpack(values, texts):
        for v, text in zip(values, texts):
            if v[3] != _OK:
                raise ValueError(f"{_ERRORS[v[3]]} (text {text.request_index}, step {len(text.tokens)})")
        return [_Draw(int(v[0]), float(v[1]), int(v[2])) for v in values]


def _apply_sampling_rule(hooks: _Hooks, step, log_probs: torch.Tensor) -> torch.Tensor:
    """The log-probabilities to draw from: the sampling rule's (checked for shape), else ``log_probs``."""
    sampling = log_probs
    if hooks.sampling_rule is not None:
        sampling = hooks.sampling_rule(step)
        if not isinstance(sampling, torch.Tensor) or sampling.shape != log_probs.shape:
            raise ValueError(
                f"sampling_rule must return a tensor of shape {tuple(log_probs.shape)}; got "
                f"{getattr(sampling, 'shape', type(sampling).__name__)}"
            )
    return sampling


# --------------------------------------------------------------------------------------------
# generic mechanisms: the outcome's distribution, the hooks, the draw and the state update

# auxiliary uniforms are kept inside (0, 1) so that quantile transforms (Laplace, normal) stay finite
_AUX_RANGE = (2.0**-60, 1.0 - 2.0**-53)


class _OutcomeMath:
    """One step of a generic :class:`~invink_audit.mechanisms.Mechanism` for the ready texts, on the device.

    Each text brings its state and its auxiliary uniforms (its own streams); the mechanism gives the
    outcome distribution (and, in exact state, every neighbour's); a sampling rule may replace it;
    each text draws its outcome by Gumbel-max with ``W`` uniforms of its own stream; the states
    advance. Outcomes, stop flags, support sizes, error codes and spends come back in one transfer.
    """

    def __init__(self, engine: Engine, run: _Run):
        self.engine, self.run = engine, run
        self.mechanism: Mechanism = engine.mechanism
        self.vocab_size = engine.model.vocab_size

    def draw(self, rows: torch.Tensor, ready: list[int], hooks: _Hooks) -> list[_Draw]:
        """The ready texts' outcomes, in ``ready`` order (one host transfer)."""
        texts = [self.run.texts[s] for s in ready]
        device = rows.device
        public, private = self._ready_rows(rows, ready, texts)
        mech, exact, vocab = self.mechanism, self.run.exact, self.vocab_size
        width = mech.num_outcomes(vocab)
        aux, uniforms = self._randomness(texts, width, device)
        state = torch.stack([t.mech_state for t in texts])
        code = torch.where(torch.isfinite(public).all(dim=-1), _OK, _BAD_PUBLIC)
        code = torch.where(torch.isfinite(private).all(dim=-1).all(dim=-1), code, _BAD_PRIVATE)
        # non-finite logits are reported (one transfer), never sampled from: zero them for the arithmetic
        finite = (code == _OK).view(-1, 1)
        public_ok = torch.where(finite, public, torch.zeros_like(public))
        private_ok = torch.where(finite.unsqueeze(-1), private, torch.zeros_like(private))
        result = mech.step(private_ok, public_ok, state, aux, exact=exact, neighbours=exact)
        log_probs = result.log_probs
        if log_probs.shape != (len(texts), width):
            raise ValueError(f"{mech.name}: step returned log_probs of shape {tuple(log_probs.shape)}; expected {(len(texts), width)}")
        step = self._hook_step(hooks, texts, public, private, result)
        sampling = _apply_sampling_rule(hooks, step, log_probs)
        code = torch.where(code == _OK, _weights_code(sampling), code)
        outcomes = gumbel_argmax(sampling.to(ACCUMULATION_DTYPE), uniforms)
        new_state, stop_after = mech.advance(result, state, outcomes, aux, exact=exact)
        if step is not None:
            stop_id = mech.stop_outcome(vocab)
            step.sampling_log_probs, step.outcomes = sampling, outcomes
            tokens = outcomes % vocab
            step.tokens = tokens if stop_id is None else torch.where(outcomes == stop_id, -1, tokens)
            if hooks.observer is not None:
                hooks.observer(step)
        spend = mech.spend(new_state)
        sizes = torch.isfinite(log_probs).sum(dim=-1)
        columns = [outcomes, stop_after, sizes, code, torch.zeros_like(sizes) if spend is None else spend]
        values = torch.stack([c.to(ACCUMULATION_DTYPE) for c in columns], dim=-1).tolist()  # one host transfer
        return self._settle(values, texts, new_state, spend)

    @staticmethod
    def _ready_rows(rows: torch.Tensor, ready: list[int], texts) -> tuple[torch.Tensor, torch.Tensor]:
        """The ready texts' public logits ``(R, V)`` and private logits ``(R, B, V)``."""
        device = rows.device
        take = to_device(ready, device)
        null = to_device([[p is None for p in t.prompts[1:]] for t in texts], device, torch.bool)
        rows = rows.index_select(0, take)
        public = rows[:, 0]
        # a null reference's row IS the public row (its logits are the public logits, bitwise)
        private = torch.where(null.unsqueeze(-1), rows[:, :1], rows[:, 1:])
        return public, private

    def _randomness(self, texts, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each text's auxiliary uniforms (inside :data:`_AUX_RANGE`) and its ``width`` Gumbel-max uniforms."""
        n_aux = self.mechanism.aux_size(exact=self.run.exact, at_start=False)
        aux = numpy.stack([t.aux.uniforms(n_aux) for t in texts]).clip(*_AUX_RANGE)
        uniforms = numpy.stack([t.stream.uniforms(width) for t in texts])
        return _upload(aux, device), _upload(uniforms, device)

    def _hook_step(self, hooks: _Hooks, texts, public, private, result) -> GenericDecodeStep | None:
        """The step the observer and sampling rule see; ``None`` without either."""
        if hooks.observer is None and hooks.sampling_rule is None:
            return None
        device = public.device
        return GenericDecodeStep(
            mechanism=self.mechanism,
            request_indices=torch.tensor([t.request_index for t in texts], device=device),
            positions=torch.tensor([len(t.tokens) for t in texts], device=device),
            public_logits=public,
            private_logits=private,
            result=result,
            vocab_size=self.vocab_size,
        )

    @staticmethod
    def _settle(values, texts, new_state: torch.Tensor, spend) -> list[_Draw]:
        """Advance each text's state (and spend) from the step's one transfer; raise on an error code."""
        for i, text in enumerate(texts):
            text.mech_state = new_state[i]
            if spend is not None:
                text.spend = values[i][4]
        for v, text in zip(values, texts):
            if v[3] != _OK:
                raise ValueError(f"{_ERRORS[int(v[3])]} (text {text.request_index}, step {len(text.tokens)})")
        return [_Draw(int(v[0]), float(v[2]), stop_after=bool(v[1])) for v in values]
