"""A release's options as one flat mapping, as the command line gives them, split into ``generate``'s typed
arguments: for tests that vary one option at a time (``dict(options, seed=3)``)."""

from __future__ import annotations

import dataclasses
import inspect

from invink_audit.data import ReferencesFile
from invink_audit.generation import GenerationConfig, GenerationHooks, ModelSpec, PromptSpec, generate

_CONFIG = set(inspect.signature(GenerationConfig).parameters)
_MODEL = {"model", "gguf_file", "device", "dtype", "max_batch_rows"}
_PROMPT = {"prompt": "template", "prompt_fields": "fields", "label_fields": "label_fields"}
_REFERENCES = {"column", "label_columns"}
_HOOKS = {f.name for f in dataclasses.fields(GenerationHooks)}


def split(references, options: dict) -> tuple:
    """(references, config, keyword arguments) of ``generate`` for the flat ``options``."""
    options = dict(options)
    pick = lambda names: {k: options.pop(k) for k in list(options) if k in names}  # noqa: E731
    files = pick(_REFERENCES)
    if files:
        references = ReferencesFile(references, **files)
    config = pick(_CONFIG)
    model, prompt, hooks = pick(_MODEL), pick(_PROMPT), pick(_HOOKS)
    kwargs = dict(options)
    if model:
        kwargs["model"] = ModelSpec(**model)
    if prompt:
        kwargs["prompt"] = PromptSpec(**{_PROMPT[k]: v for k, v in prompt.items()})
    if hooks:
        kwargs["hooks"] = GenerationHooks(**hooks)
    return references, GenerationConfig(**config), kwargs


def generate_flat(references, **options):
    """``generate`` with flat options (module docstring)."""
    references, config, kwargs = split(references, options)
    return generate(references, config, **kwargs)


def call_flat(function, references, **options):
    """``function(references, config, **kwargs)`` (``generate_on_ray``, ``prepare_release``) with flat options;
    options it alone takes (``concurrency``) pass through."""
    references, config, kwargs = split(references, options)
    return function(references, config, **kwargs)
