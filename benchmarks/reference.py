"""The reference package (PyPI ``invink`` 0.1.0) timed on the benchmark's workload (:func:`time_reference`): the same
G texts of the same B references and prompts, one text after another as it works, calling
``model.generate(max_new_tokens=1)`` once per token and moving the logits through numpy. It is not a dependency;
``invink-audit bench --reference`` needs it importable."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import time
import warnings
from collections.abc import Sequence

from invink_audit.prompts import PromptTemplate, get_preset

from .workload import reference_pool, workload_texts

@dataclasses.dataclass(frozen=True)
class ReferenceTiming:
    """Wall-clock cost of the reference package's decode loop on the benchmark's workload.

    ``seconds`` is its decode loop alone (prompt encoding, prefill and every per-token step of every
    text); ``setup_seconds`` the rest of its ``generate`` call except model loading. ``token_seconds`` =
    ``seconds`` / ``tokens`` (it stops at end-of-sequence unless timed with ``stop_at_eos=False``). ``dtype`` is
    the dtype its model ran in; ``requested_dtype`` and ``requested_device_map`` are ``None`` where the package
    chose (its defaults: bfloat16, which it turns into float16 on a machine without CUDA bfloat16, and
    ``device_map="auto"``, which places the model through accelerate's dispatch hooks).
    """

    token_seconds: float
    tokens: int
    seconds: float
    setup_seconds: float
    version: str
    dtype: str
    requested_dtype: str | None
    requested_device_map: str | int | None

    @property
    def configuration(self) -> str:
        """``"shipped"`` when dtype and device map are the package's defaults, else what was forced."""
        if self.requested_dtype is None and self.requested_device_map is None:
            return "shipped"
        return f"dtype={self.requested_dtype or 'default'}, device_map={self.requested_device_map!r}"


def _positional_prompts(template: PromptTemplate) -> tuple[str, str, str]:
    """``template`` in the reference package's positional format: (dataset description, private, public)."""
    description = template.fields.get("description", "")
    private = template.private.replace("{description}", "{0}").replace("{reference}", "{1}")
    public = template.public.replace("{description}", "{0}")
    return description, private, public


@dataclasses.dataclass
class _ReferenceClock:
    """What the reference package's patched hooks measure: model loading, its decode loop, its model's dtype."""

    loading: list[float] = dataclasses.field(default_factory=list)
    loop: list[float] = dataclasses.field(default_factory=list)
    dtypes: list[str] = dataclasses.field(default_factory=list)
    stop_at_eos: bool = True

    def timed_load(self, load):
        """``load`` (its ``load_hf_model``), timed, recording the loaded model's dtype; without ``stop_at_eos``
        the model's ``generation_config.eos_token_id`` becomes an id outside its vocabulary: its loop stops a text
        on that id only."""

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                model = load(*args, **kwargs)
            finally:
                self.loading.append(time.perf_counter() - started)
            self.dtypes.append(str(model.dtype).removeprefix("torch."))
            if not self.stop_at_eos:  # an id it never draws (its sampling is over the model's vocab_size ids)
                model.generation_config.eos_token_id = model.config.vocab_size
            return model

        return timed

    def timed_loop(self, iterable, *args, **kwargs):
        """Stands in for its ``tqdm``: the loop over its texts, timed from first to last."""
        started = time.perf_counter()
        yield from iterable
        self.loop.append(time.perf_counter() - started)


@contextlib.contextmanager
def _clocked(reference, stop_at_eos: bool = True):
    """Patch the reference module's ``load_hf_model`` and ``tqdm`` with a :class:`_ReferenceClock`'s, undone on exit."""
    clock = _ReferenceClock(stop_at_eos=stop_at_eos)
    original_load, original_tqdm = reference.load_hf_model, reference.tqdm
    reference.load_hf_model, reference.tqdm = clock.timed_load(original_load), clock.timed_loop
    try:
        yield clock
    finally:
        reference.load_hf_model, reference.tqdm = original_load, original_tqdm


def time_reference(
    model_dir: str,
    *,
    batch_size: int = 7,
    max_new_tokens: int = 32,
    num_texts: int = 1,
    references: Sequence[str] | None = None,
    template: PromptTemplate | str = "generic",
    temperature: float = 1.0,
    top_k: int = 100,
    dtype: str | None = None,
    device_map: str | int | None = None,
    stop_at_eos: bool = True,
) -> ReferenceTiming:
    """Time the reference ``invink`` package's decode loop on the benchmark's workload.

    The workload is the one :func:`benchmark` runs: ``num_texts`` texts, each from ``batch_size``
    references of the same pool (its ``batch_size`` argument is ``B + 1``), our prompt template in its
    positional format (the same prompts but for our answer prefix, a few tokens it has no field for),
    ``max_toks = T`` explicitly. ``dtype=None`` and
    ``device_map=None`` leave them to the package (its shipped defaults); a value forces one (its
    ``device_map`` takes ``-1`` for CPU, a CUDA index, or ``"auto"``). The decode loop is timed from
    its first text to its last (its ``tqdm`` loop); model loading and its other setup are excluded
    from ``token_seconds``. ``stop_at_eos=False``: every text draws ``max_new_tokens`` (end-of-sequence does
    not stop it; ``ValueError``, one line from the command, if one stopped early). Raises ``ImportError`` when
    it is not installed.
    """
    import importlib
    import importlib.metadata

    # ``invink.generate`` the attribute is the function; the module is in sys.modules
    reference = importlib.import_module("invink.generate")  # ImportError: not installed

    template = get_preset(template)
    description, private, public = _positional_prompts(template)
    texts = [text for batch in workload_texts(reference_pool(references), batch_size, num_texts) for text in batch]
    options = {name: value for name, value in (("dtype", dtype), ("device_map", device_map)) if value is not None}
    with _clocked(reference, stop_at_eos) as clock:
        started = time.perf_counter()
        out = _call_reference(
            reference, texts, model_dir=model_dir, system=template.system, prompts=(description, private, public),
            batch_size=batch_size, num_texts=num_texts, max_new_tokens=max_new_tokens, temperature=temperature,
            top_k=top_k, options=options,
        )  # fmt: skip
    total = time.perf_counter() - started
    if len(clock.loop) != 1:
        raise RuntimeError("could not time the reference package's decode loop (its tqdm loop was not used)")
    tokens = int(sum(out.lens))
    if not stop_at_eos and tokens != num_texts * max_new_tokens:
        raise ValueError(f"the reference package drew {tokens} tokens, not {num_texts} x {max_new_tokens}: "
                           "its end-of-sequence stop was not disabled")
    return ReferenceTiming(
        token_seconds=clock.loop[0] / tokens,
        tokens=tokens,
        seconds=clock.loop[0],
        setup_seconds=total - clock.loop[0] - sum(clock.loading),
        version=importlib.metadata.version("invink") if _has_metadata("invink") else "unknown",
        dtype=clock.dtypes[0] if clock.dtypes else "unknown",
        requested_dtype=dtype,
        requested_device_map=device_map,
    )


def _call_reference(
    reference, texts: list[str], *, model_dir: str, system, prompts: tuple[str, str, str], batch_size: int,
    num_texts: int, max_new_tokens: int, temperature: float, top_k: int, options: dict,
):  # fmt: skip
    """One call of the reference package's ``generate`` on the workload (:func:`time_reference`), its
    output and warnings silenced: ``prompts`` = (dataset description, private, public) in its positional
    format, ``batch_size + 1`` rows per text (it counts the public row), ε = 10, seed 0, no download;
    ``options``: its ``dtype`` / ``device_map`` where forced. Returns its output."""
    description, private, public = prompts
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return reference.generate(
            texts,
            model_name_or_path=model_dir,
            dataset_desc=description,
            system_prompt=system,
            pub_prompt=public,
            prv_prompt=private,
            epsilon=10.0,
            batch_size=batch_size + 1,
            num=num_texts,
            max_toks=max_new_tokens,
            temperature=temperature,
            topk=top_k,
            drop_empty=False,
            allow_download=False,
            trust_remote_code=False,
            random_seed=0,
            **options,
        )


def _has_metadata(name: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True

