"""The processes of one release: ranks under ``torchrun`` / ``accelerate launch``, and who does what.

Each process takes whole batches (disjoint batches compose in parallel, paper Corollary 11,
coro:parallel-batches); rank 0 validates, plans and charges the ledger once (:meth:`Cluster.lead`) and
sends each process only its own batches' stream keys (:meth:`Cluster.scatter`). A launch across machines
is refused unless ``INVINK_ALLOW_MULTI_MACHINE=1`` (:func:`check_single_machine`).

Design: docs/guide/scaling-out.md (§"How a multi-process run goes", §"What travels over the process group").
"""

from __future__ import annotations

import dataclasses
import atexit
import datetime
import heapq
import ipaddress
import os
import pickle
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

from accounting.limits import check_count

__all__ = [
    "Cluster",
    "RankFailure",
    "ReleaseIncompleteError",
    "assign_batches",
    "check_single_machine",
    "current_cluster",
    "launch_rank",
    "launch_world_size",
    "request_cost",
]

#: How long a process waits for the others at a meeting point (rank 0 loading the model and charging,
#: the slowest process finishing its batches). A process that dies closes its connections, so the others
#: fail at once rather than after this timeout. ``INVINK_DIST_TIMEOUT_S`` overrides it.
DEFAULT_TIMEOUT_S = 24 * 3600


class ReleaseIncompleteError(RuntimeError):
    """A process of a multi-process release failed: the texts finished so far are kept, and running the
    same command again generates only the missing batches."""


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """An exception raised on one rank, carried to the others (the exception itself when it pickles)."""

    rank: int
    error: BaseException

    @classmethod
    def of(cls, rank: int, error: BaseException) -> RankFailure:
        try:
            portable = pickle.loads(pickle.dumps(error))
        except Exception:  # noqa: BLE001 - any unpicklable exception is carried as its message
            portable = RuntimeError(f"{type(error).__name__}: {error}")
        return cls(rank, portable)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """This process's place in the release: ``rank`` of ``world_size`` (``local_rank`` on its machine)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: object = None  # the gloo process group to talk over (None: the default group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def scatter(self, parts: Sequence | None = None):
        """Rank 0's ``parts[r]`` on rank ``r``: each process receives its own part and nothing of the
        others' (rank 0 sends it to that process alone; ``parts`` is ignored on the other ranks)."""
        if not self.distributed:
            return parts[0]
        import torch.distributed as dist

        if self.is_main:
            if len(parts) != self.world_size:
                raise ValueError(f"scatter needs one part per process ({self.world_size}); got {len(parts)}")
            for rank in range(1, self.world_size):
                dist.send_object_list([parts[rank]], dst=rank, group=self.group)
            return parts[0]
        box = [None]
        dist.recv_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj) -> list | None:
        """Every rank's ``obj``, in rank order, on rank 0 (``None`` elsewhere)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def lead(self, fn: Callable[[], object], *, share: bool = False):
        """``fn()`` on rank 0 only, the other ranks waiting; an exception it raises is raised on every
        rank. Returns its result on rank 0, and on every rank when ``share`` (else ``None`` elsewhere)."""
        if not self.distributed:
            return fn()
        result = failure = None
        if self.is_main:
            try:
                result = fn()
            except BaseException as err:
                self.broadcast((RankFailure.of(0, err), None))
                raise
        failure, shared = self.broadcast((None, result if share else None))
        if failure is not None:
            raise failure.error
        return result if self.is_main else shared

    def agree(self, error: BaseException | None) -> None:
        """Every rank reports whether its part succeeded; if any failed, every rank raises the first
        failure (an error on one rank never leaves the others waiting)."""
        first = None
        if self.distributed:
            reports = self.gather(None if error is None else RankFailure.of(self.rank, error))
            first = self.broadcast(next((r for r in reports if r is not None), None) if self.is_main else None)
        if error is not None:
            raise error
        if first is not None:
            raise first.error

    def check_same(self, value, what: str) -> None:
        """Refuse, on every rank, unless every rank holds the same ``value`` as rank 0 (``what`` names it
        in the error): processes launched separately (one command line per machine) must agree."""
        if not self.distributed:
            return
        values = self.gather(value)
        message = None
        if self.is_main:
            differ = [rank for rank, other in enumerate(values) if other != values[0]]
            if differ:
                message = (
                    f"process(es) {differ} of {self.world_size} were launched with other {what} than process 0: "
                    "every process of one release must run the same command on the same files; nothing was charged"
                )
        message = self.broadcast(message)
        if message is not None:
            raise ValueError(message)

    def device(self, requested):
        """The device this rank uses: with several processes and CUDA, ``cuda:LOCAL_RANK`` unless the
        caller named a device (``cpu`` or a specific ``cuda:N``)."""
        if not self.distributed:
            return requested
        import torch

        text = None if requested is None else str(requested)
        if text in (None, "auto", "cuda") and torch.cuda.is_available():
            return f"cuda:{self.local_rank % torch.cuda.device_count()}"
        return requested


_CLUSTER: Cluster | None = None
_OWNED = False  # whether current_cluster initialised the default process group (and shutdown destroys it)


#: Where launchers put a process's place: torchrun and ``accelerate launch --multi_gpu`` set the first
#: name; ``accelerate launch --cpu`` with mpirun leaves it to the MPI implementation (Open MPI, MPICH /
#: Intel MPI, MVAPICH), as accelerate itself reads them.
_ENV_NAMES = {
    "WORLD_SIZE": ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"),
    "RANK": ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK"),
    "LOCAL_RANK": ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK"),
    "LOCAL_WORLD_SIZE": ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"),
}


def _env_int(name: str, default: int | None = None) -> int:
    found = next(((n, os.environ[n]) for n in _ENV_NAMES.get(name, (name,)) if n in os.environ), None)
    if found is None:
        if default is None:
            raise ValueError(f"{name} is not set: launch with torchrun or accelerate launch, or unset WORLD_SIZE")
        return default
    variable, text = found
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {variable}={text!r} is not an integer") from None


def launch_rank() -> int:
    """This process's rank as the launcher set it (0 without a launcher), before any process group exists:
    the CLI uses it to let rank 0 alone show progress and print."""
    return _env_int("RANK", 0)


def launch_world_size() -> int:
    """The number of processes the launcher started (1 without a launcher)."""
    return _env_int("WORLD_SIZE", 1)


def _timeout() -> datetime.timedelta:
    text = os.environ.get("INVINK_DIST_TIMEOUT_S", str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"INVINK_DIST_TIMEOUT_S={text!r} is not a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"INVINK_DIST_TIMEOUT_S must be > 0; got {text!r}")
    return datetime.timedelta(seconds=seconds)


#: Set to ``1`` on every machine to run one release over several machines (see :func:`check_single_machine`).
ALLOW_MULTI_MACHINE_ENV = "INVINK_ALLOW_MULTI_MACHINE"


def _allows_multi_machine() -> bool:
    text = os.environ.get(ALLOW_MULTI_MACHINE_ENV, "").strip().lower()
    if text in ("", "0", "false", "no"):
        return False
    if text in ("1", "true", "yes"):
        return True
    raise ValueError(f"{ALLOW_MULTI_MACHINE_ENV}={os.environ[ALLOW_MULTI_MACHINE_ENV]!r} must be 1 (allow) or 0 (refuse)")


def _is_local_address(address: str) -> bool:
    """Whether ``address`` (an IP literal) is one of this machine's: loopback, or bindable here (binding a
    socket to another machine's address fails with EADDRNOTAVAIL; nothing is sent)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if ip.is_loopback:
        return True
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def _is_this_machine(host: str) -> bool:
    """Whether ``host`` (``MASTER_ADDR``: a name or an IP literal) names this machine. A name must resolve,
    and every address it resolves to must be this machine's."""
    name = host.strip().removeprefix("[").removesuffix("]")
    if not name:
        return False
    if name.lower() == "localhost":
        return True
    try:
        return _is_local_address(name)
    except ValueError:  # not an IP literal: a host name
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return False
    return bool(addresses) and all(_is_local_address(a) for a in addresses)


def _machines_reason(world: int) -> str | None:
    """Why the launcher's environment says that this launch of ``world`` processes spans machines (``None``
    when it does not): fewer processes on this machine than in all (``LOCAL_WORLD_SIZE`` < ``WORLD_SIZE``,
    as torchrun and accelerate set them, or the MPI equivalents), or a ``MASTER_ADDR`` that is not this
    machine."""
    if world <= 1:
        return None
    local = _env_int("LOCAL_WORLD_SIZE", world)
    if local < world:
        return f"WORLD_SIZE={world} processes but LOCAL_WORLD_SIZE={local} on this machine"
    master = os.environ.get("MASTER_ADDR")
    if master is not None and not _is_this_machine(master):
        return f"MASTER_ADDR={master!r} is not an address of this machine"
    return None


def check_single_machine(world: int) -> None:
    """Refuse a launch of ``world`` processes that spans machines (:func:`_machines_reason`) unless
    ``INVINK_ALLOW_MULTI_MACHINE=1``: the process group is neither authenticated nor encrypted (module
    docstring). Every process decides from its own environment, before any process group exists, so a
    refused launch exchanges nothing."""
    reason = _machines_reason(world)
    if reason is None or _allows_multi_machine():
        return
    raise ValueError(
        f"this launch spans more than one machine ({reason}); refused, nothing was run or charged. The processes "
        "talk over torch.distributed (gloo, found through a TCPStore), which is neither authenticated nor "
        "encrypted: rank 0 sends each process pickled Python objects holding the random stream keys of its "
        "batches (whoever reads them can take the sampling noise out of those texts), the release id and the batch "
        "assignment, and the processes send rank 0 pickles of their settings digests, texts and failures; every "
        "process unpickles what reaches it, so whoever can reach the ports can run code in it. Launch on several "
        "machines only over a network you trust (a private cluster network, or a tunnel such as WireGuard or SSH), "
        f"and then set {ALLOW_MULTI_MACHINE_ENV}=1 in the environment of every process"
    )


def current_cluster() -> Cluster:
    """This process's :class:`Cluster`: initialises a gloo process group from the launcher's environment
    the first time (``WORLD_SIZE`` > 1), or uses the one the caller initialised."""
    global _CLUSTER, _OWNED
    import torch.distributed as dist

    if not dist.is_available():
        return Cluster()
    if dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        if _CLUSTER is not None and (_CLUSTER.rank, _CLUSTER.world_size) == (rank, world):
            return _CLUSTER
        check_single_machine(world)
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=_timeout())
        _CLUSTER = Cluster(rank, world, _env_int("LOCAL_RANK", rank), group)
        return _CLUSTER
    world = _env_int("WORLD_SIZE", 1)
    if world < 1:
        raise ValueError(f"WORLD_SIZE must be >= 1; got {world}")
    if world == 1:
        return Cluster()
    rank = _env_int("RANK")
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(f"WORLD_SIZE={world} but {name} is not set: launch with torchrun or accelerate launch")
    check_single_machine(world)
    dist.init_process_group(backend="gloo", timeout=_timeout(), rank=rank, world_size=world)
    # a gloo group left for interpreter finalisation can abort the process (SIGABRT, "terminate called
    # without an active exception": pytorch/pytorch#190489); the CLI shuts down explicitly, this covers
    # library callers
    _OWNED = True
    atexit.register(shutdown)
    _CLUSTER = Cluster(rank, world, _env_int("LOCAL_RANK", rank), None)
    return _CLUSTER


def shutdown() -> bool:
    """Destroy the process group :func:`current_cluster` initialised (a no-op otherwise, and the second
    time); returns whether it did. A group the caller initialised is the caller's to destroy.

    This is not enough to exit cleanly: a rank of a complete release still aborted in interpreter
    finalisation with "terminate called without an active exception" (pytorch/pytorch#190489; about 1 run
    in 10 of two CPU processes here, 0 in 44 with ``os._exit``), so the CLI ends with :func:`exit_process`."""
    global _CLUSTER, _OWNED
    if not _OWNED:
        return False
    import torch.distributed as dist

    _CLUSTER, _OWNED = None, False
    if dist.is_initialized():
        dist.destroy_process_group()
    return True


def exit_process(status: int) -> NoReturn:
    """End this process now with ``status``, skipping interpreter finalisation (after flushing stdout,
    stderr and logging): what a process of a torchrun/accelerate launch does once its work is written
    and its process group destroyed, so that no native thread left by the collective library can abort
    it at exit (:func:`shutdown`). Everything the CLI writes is closed and synced before this point."""
    import logging
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be written anyway
            pass
    logging.shutdown()
    os._exit(status)


def assign_batches(costs: Mapping[int, float], world_size: int) -> list[list[int]]:
    """Whole batches per rank, balancing estimated cost: longest processing time first (Graham 1969,
    within 4/3 of the best makespan). Deterministic (ties by batch index, then rank); each rank's
    batches in index order. A batch's text does not depend on the rank that draws it (its random stream
    is keyed by the release key and its batch index), so any assignment gives the same release."""
    check_count("world_size", world_size)
    parts: list[list[int]] = [[] for _ in range(world_size)]
    loads = [(0.0, rank) for rank in range(world_size)]
    for index in sorted(costs, key=lambda i: (-float(costs[i]), i)):
        load, rank = heapq.heappop(loads)
        parts[rank].append(index)
        heapq.heappush(loads, (load + float(costs[index]), rank))
    return [sorted(part) for part in parts]


def batch_cost(prompt_lengths: Sequence[int], max_new_tokens: int) -> float:
    """Estimated work of one batch: its prompt tokens (prefill) plus its rows times T (decoding)."""
    return float(sum(prompt_lengths) + len(prompt_lengths) * max_new_tokens)


def request_cost(request, max_new_tokens: int) -> float:
    """:func:`batch_cost` of a :class:`~invink_audit.prompts.TextRequest` from its *public* part only:
    its B + 1 rows each counted at the public prompt's length. The private prompts' lengths must not
    decide which process draws a batch: the batches a process holds share its decoding passes, so
    an assignment that followed a private length would let one batch's references change another
    batch's public-row arithmetic (and the processes' timing). Label-conditioned public prompts still
    balance by their own lengths."""
    lengths = [len(request.public_ids)] * (1 + len(request.private_ids))
    return batch_cost(lengths, max_new_tokens)
