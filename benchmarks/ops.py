"""Kernel-launching operations per decoding step: what bounds a step on a GPU (docs/design/engine.md, "On a GPU"),
counted on any device: the engine's private step against a plain padded transformers decode of the same rows."""

from __future__ import annotations

import dataclasses
import inspect
import statistics

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from accounting.limits import check_count
from invink_audit.engine import Engine

from .workload import row_prompts, seeded_generator, to_length

_ATEN = torch.ops.aten
#: operations that allocate or alias without running a kernel (views are recognised by their schema)
_NO_KERNEL = frozenset(
    getattr(_ATEN, name) for name in ("empty", "empty_strided", "detach", "alias", "lift_fresh", "set_", "resize_")
)


class KernelOpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched that launch a kernel: every one, less views (``OpOverload.is_view``:
    they only alias a tensor's storage) and the allocating or aliasing operations of :data:`_NO_KERNEL`. The
    count is the same on every device: one launch per operation on CUDA (more for a few composite ones), one
    kernel call on a CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket not in _NO_KERNEL:
            self.count += 1
        return func(*args, **(kwargs or {}))


@dataclasses.dataclass(frozen=True)
class DecodeOps:
    """Kernel-launching operations per decoding step (medians over ``steps`` steps after the first): the
    engine's private step (forward passes, the mechanism's math and sampling) with its rows' caches in
    ``layout`` (``Engine.kv_layout``), and a plain padded transformers decode of the same rows (one left-padded
    batch, its attention mask and cache, one forward, a softmax and a multinomial draw per step)."""

    engine: float
    padded: float
    steps: int
    layout: str = "pool"

    @property
    def ratio(self) -> float:
        return self.engine / self.padded

    def to_json(self) -> dict:
        return {"engine": self.engine, "padded": self.padded, "ratio": self.ratio, "steps": self.steps,
                "layout": self.layout}


def count_decode_ops(engine: Engine, requests, steps: int = 4) -> DecodeOps:
    """:class:`DecodeOps` of ``requests`` (each row's prompt as the workload has it), over ``steps`` decoding
    steps of each (the first step, which prefills, is not counted), on ``engine`` as it is (its ``kv_layout``), its
    passes run eagerly: on CUDA a captured pass is one graph launch from the host, the operations counted here
    its kernels."""
    check_count("steps", steps, minimum=1)
    device = engine.model.device
    counter, ticks = KernelOpCounter(), []
    graphs, engine.forward.graphs.enabled = engine.forward.graphs.enabled, False  # a replay hides its operations
    try:
        with counter:
            for _ in engine.generate(to_length(requests), max_new_tokens=steps + 1, generator=seeded_generator(device),
                                     stop_at_eos=False, progress=lambda _n: ticks.append(counter.count)):
                pass
    finally:
        engine.forward.graphs.enabled = graphs
    ours = [after - before for before, after in zip(ticks, ticks[1:])]
    return DecodeOps(statistics.median(ours), padded_decode_ops(engine, requests, steps), steps, engine.kv_layout)


def padded_decode_ops(engine: Engine, requests, steps: int) -> float:
    """Median operations per step of a plain padded transformers decode of the workload's rows."""
    network, device = engine.model.model, engine.model.device
    prompts = row_prompts(requests)
    width = max(len(p) for p in prompts)
    pad = engine.model.eos_token_ids[0]
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    name, gen = cache_argument(network), seeded_generator(device)
    with torch.inference_mode():
        out = network(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        cache, logits, counts = getattr(out, name), out.logits[:, -1], []
        for _ in range(steps):
            counter = KernelOpCounter()
            with counter:
                token = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=gen)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                positions = mask.sum(dim=1, keepdim=True) - 1
                out = network(input_ids=token, attention_mask=mask, position_ids=positions, use_cache=True,
                              logits_to_keep=1, **{name: cache})
            cache, logits = getattr(out, name), out.logits[:, -1]
            counts.append(counter.count)
    return statistics.median(counts)


def cache_argument(module) -> str:
    """The name of a transformers model's key/value cache, as its ``forward`` argument and in its output:
    ``cache`` from transformers 5.24 on (which deprecates ``past_key_values``), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"

