"""How ranks exchange tensors: torch.distributed (gloo on CPU, NCCL on CUDA) or threads in one process.

Both transports offer the same operations: `isend` (non-blocking), `irecv` (posts a receive now and
returns a handle whose `wait` gives the payload), `recv` (blocking, bounded by a timeout), `exchange`
(sends and posted receives issued together), `allreduce` (sum over a group of ranks, in place),
`reduce_scatter` and `all_gather` (a sharded stage's, ZeRO-1: NCCL's own; gloo has no reduce-scatter, so
there it is an allreduce of which each member keeps its chunk, and the gather is gloo's `all_gather`) and
`close`. A payload is a tensor or a small non-tensor value (an int from `size()`, a tuple of ints, a
float, a bool, None); non-tensors travel as JSON text, never pickled. Every wait has a timeout (on
CUDA, where waits order the stream instead of blocking the host, the process group's); a wait that
runs out, or a peer that failed, raises `TransportError`, which the launcher treats as a consequence
of another rank's failure rather than a cause.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dapple_ir.errors import DappleError

#: Dtypes a payload tensor may have, by the code its header carries.
_DTYPES: list[torch.dtype] = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
_HEADER_LEN = 16
_MAX_DIMS = _HEADER_LEN - 4
_KIND_TENSOR, _KIND_JSON = 0, 1


class TransportError(DappleError):
    """A wait that timed out or a peer that went away: usually the echo of another rank's failure."""


class Pending(Protocol):
    """A send in flight."""

    def wait(self, timeout: float) -> None: ...


class PendingRecv(Protocol):
    """A receive posted ahead of its use: `wait` blocks (bounded) until the payload is here and returns it."""

    def wait(self, timeout: float) -> Any: ...


class PointToPoint(Protocol):
    """The point-to-point half of a transport (what `exchange_each` and a late receive use)."""

    def isend(self, payload: Any, peer: int, tag: int) -> Pending: ...

    def irecv(self, peer: int, tag: int) -> PendingRecv: ...

    def recv(self, peer: int, tag: int, timeout: float) -> Any: ...


class Transport(Protocol):
    """What the runtime needs from a transport."""

    rank: int
    world: int

    def isend(self, payload: Any, peer: int, tag: int) -> Pending: ...

    def irecv(self, peer: int, tag: int) -> PendingRecv: ...

    def recv(self, peer: int, tag: int, timeout: float) -> Any: ...

    def exchange(
        self, sends: list[tuple[Any, int, int]], recvs: list[tuple[int, int]]
    ) -> tuple[list[Pending], list[PendingRecv]]: ...

    def allreduce(self, tensor: torch.Tensor, group: tuple[int, ...], timeout: float) -> None: ...

    def reduce_scatter(self, tensor: torch.Tensor, group: tuple[int, ...], timeout: float) -> None:
        """Sum `tensor` (n equal chunks, n = len(group)) over `group`: member k's chunk k holds the sum after,
        its other chunks are left unspecified."""
        ...

    def all_gather(self, tensor: torch.Tensor, group: tuple[int, ...], timeout: float) -> None:
        """In place: chunk k of `tensor` (n equal chunks) becomes member k's chunk k."""
        ...

    def close(self) -> None: ...


def exchange_each(
    transport: PointToPoint, sends: list[tuple[Any, int, int]], recvs: list[tuple[int, int]]
) -> tuple[list[Pending], list[PendingRecv]]:
    """`exchange` one message at a time: each send (payload, peer, tag) issued, then each receive (peer, tag) posted."""
    return [transport.isend(*send) for send in sends], [transport.irecv(*recv) for recv in recvs]


def to_jsonable(value: Any) -> Any:
    """A non-tensor payload as JSON data; tuples and `torch.Size` become tagged lists."""
    if isinstance(value, tuple | list):
        return {"tuple" if isinstance(value, tuple) else "list": [to_jsonable(v) for v in value]}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise DappleError(
        f"cannot send a value of type {type(value).__name__} between stages; only tensors, numbers, "
        "strings, None and tuples of them cross stage boundaries"
    )


def from_jsonable(data: Any) -> Any:
    if isinstance(data, dict):
        items = [from_jsonable(v) for v in data.get("tuple") or data.get("list") or []]
        return tuple(items) if "tuple" in data else items
    return data


# ---------------------------------------------------------------------------- threads (one process)


@dataclass
class ThreadHub:
    """State the in-process ranks share: mailboxes, collective slots and the abort flag."""

    world: int
    cond: threading.Condition = field(default_factory=threading.Condition)
    mail: dict[tuple[int, int, int], deque[Any]] = field(default_factory=dict)
    slots: dict[tuple[tuple[int, ...], int], dict[int, torch.Tensor]] = field(default_factory=dict)
    results: dict[tuple[tuple[int, ...], int], tuple[torch.Tensor, set[int]]] = field(default_factory=dict)
    failed: list[tuple[int, str]] = field(default_factory=list)

    def fail(self, rank: int, message: str) -> None:
        with self.cond:
            self.failed.append((rank, message))
            self.cond.notify_all()

    def wait_for(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Waits (holding `cond`) until `ready()`; raises on timeout or when another rank failed."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self.failed:
                rank, _ = self.failed[0]
                raise TransportError(f"stopped while {what}: rank {rank} failed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"timed out after {timeout:g} s {what}")
            self.cond.wait(min(left, 0.5))


class _Done:
    def wait(self, timeout: float) -> None:
        return None


@dataclass
class _Later:
    """A receive posted on a transport that has nothing to post ahead: it receives when waited on."""

    transport: PointToPoint
    peer: int
    tag: int

    def wait(self, timeout: float) -> Any:
        return self.transport.recv(self.peer, self.tag, timeout)


@dataclass
class ThreadTransport:
    """One rank's view of a `ThreadHub`. Sends copy the payload, so the sender may reuse its tensor."""

    hub: ThreadHub
    rank: int
    calls: dict[tuple[int, ...], int] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.hub.world

    def isend(self, payload: Any, peer: int, tag: int) -> Pending:
        copy = payload.detach().clone() if isinstance(payload, torch.Tensor) else payload
        with self.hub.cond:
            self.hub.mail.setdefault((self.rank, peer, tag), deque()).append(copy)
            self.hub.cond.notify_all()
        return _Done()

    def irecv(self, peer: int, tag: int) -> PendingRecv:
        # The mailbox already holds whatever was sent: posting ahead would change nothing.
        return _Later(self, peer, tag)

    def exchange(
        self, sends: list[tuple[Any, int, int]], recvs: list[tuple[int, int]]
    ) -> tuple[list[Pending], list[PendingRecv]]:
        return exchange_each(self, sends, recvs)

    def recv(self, peer: int, tag: int, timeout: float) -> Any:
        with self.hub.cond:
            box = self.hub.mail.setdefault((peer, self.rank, tag), deque())
            self.hub.wait_for(lambda: bool(box), timeout, f"on rank {self.rank} receiving tag {tag} from rank {peer}")
            return box.popleft()

    def allreduce(self, tensor: torch.Tensor, group: tuple[int, ...], timeout: float) -> None:
        self._collective(tensor, group, timeout, "allreduce", _sum_in_order)

    def reduce_scatter(self, tensor: torch.Tensor, group: tuple[int, ...], timeout: float) -> None:
        # Every member gets the whole sum (the same bits as `allreduce`) and keeps its chunk.
        self._collective(tensor, group, timeout, "reduce_scatter", _sum_in_order)

    def all_gather(self, tensor: torch.Tensor, group: tuple[int, ...], timeout: float) -> None:
        self._collective(tensor, group, timeout, "all_gather", _gather_chunks)

    def _collective(
        self,
        tensor: torch.Tensor,
        group: tuple[int, ...],
        timeout: float,
        name: str,
        combine: Callable[[tuple[int, ...], dict[int, torch.Tensor]], torch.Tensor],
    ) -> None:
        """Every member's `tensor` becomes `combine(group, each member's tensor)`; collectives over one group
        meet in program order (the rank programs call them in the same order on every member)."""
        if len(group) < 2:
            return
        call = self.calls.get(group, 0)
        self.calls[group] = call + 1
        key = (group, call)
        what = f"on rank {self.rank} in {name} over ranks {list(group)}"
        with self.hub.cond:
            self.hub.slots.setdefault(key, {})[self.rank] = tensor.detach().clone()
            if len(self.hub.slots[key]) == len(group):
                self.hub.results[key] = (combine(group, self.hub.slots.pop(key)), set())
                self.hub.cond.notify_all()
            self.hub.wait_for(lambda: key in self.hub.results, timeout, what)
            total, readers = self.hub.results[key]
            tensor.copy_(total)
            readers.add(self.rank)
            if len(readers) == len(group):
                del self.hub.results[key]


def _sum_in_order(group: tuple[int, ...], parts: dict[int, torch.Tensor]) -> torch.Tensor:
    """The members' tensors summed in group order: every participant gets the very same bits."""
    total = parts[group[0]].clone()
    for r in group[1:]:
        total += parts[r]
    return total


def _gather_chunks(group: tuple[int, ...], parts: dict[int, torch.Tensor]) -> torch.Tensor:
    """Chunk k of member k's tensor, for every k."""
    n = len(group)
    return torch.cat([parts[r].chunk(n)[k] for k, r in enumerate(group)])

    def close(self) -> None:
        return None


# ------------------------------------------------------------------------------ torch.distributed


@dataclass
class _DistPending:
    works: list[Any]
    keep: list[torch.Tensor]
    what: str
    on_stream: bool = False

    def wait(self, timeout: float) -> None:
        for work in self.works:
            _wait(work, timeout, self.what, self.on_stream)


@dataclass
class _PostedBody:
    """A posted receive of a tensor whose shape is known: waiting returns the filled buffer."""

    transport: DistTransport
    peer: int
    tag: int
    body: torch.Tensor
    work: Any
    """The receive's work, or the works of the batch it was posted in."""

    def wait(self, timeout: float) -> Any:
        for work in self.work if isinstance(self.work, list) else [self.work]:
            _wait(work, timeout, self.transport._what(self.peer, self.tag), self.transport.on_stream)
        return self.body


@dataclass
class _PostedHeader:
    """A posted receive of a first message: waiting reads the header, then receives the body it announces."""

    transport: DistTransport
    peer: int
    tag: int
    header: torch.Tensor
    work: Any

    def wait(self, timeout: float) -> Any:
        # The header is read on the host (once per (peer, tag) per run): a host wait, even on CUDA.
        _wait(self.work, timeout, self.transport._what(self.peer, self.tag))
        return self.transport._body(self.peer, self.tag, self.header, timeout)


def _wait(work: Any, timeout: float, what: str, on_stream: bool = False) -> None:
    """Wait for a transfer or collective. `on_stream` (CUDA): make the current stream wait for it instead of the
    host, so compute already queued keeps the GPU busy; a hang is then bounded by the process group's
    timeout (the one `init_process_group` got), after which NCCL's watchdog aborts the rank."""
    if on_stream:
        try:
            work.wait()
        except Exception as exc:
            raise TransportError(f"{what} failed: {_first_line(exc)}") from exc
        return
    try:
        ok = work.wait(timedelta(seconds=timeout))
    except Exception as exc:  # gloo raises on timeouts and on peers that closed their socket
        raise TransportError(f"{what} failed: {_first_line(exc)}") from exc
    if ok is False:
        raise TransportError(f"timed out after {timeout:g} s {what}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _storage_refs(tensor: torch.Tensor) -> int | None:
    """How many holders the tensor's memory has (tensors, views, autograd's saved copies), counting the tensor
    and the storage object this call makes; None where this torch does not say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return int(count(tensor.untyped_storage()._cdata)) if count is not None else None


@dataclass
class ReceiveBuffers:
    """Receive buffers allocated once per (dtype, shape) and handed to a later receive when nobody holds them.

    A buffer is free when its memory has no holder but the pool: the runtime let go of the value (or gradient)
    and autograd of every graph that saved it. That is read from the storage's reference count at each take,
    so reuse never depends on a release point being right; a buffer still held is skipped and a new one made.
    The pool grows to the most buffers of a shape alive at once, which the memory model already counts at the
    peak. Exact: a receive overwrites the whole buffer. On CUDA a buffer is taken again only by a receive issued
    after the host dropped it, so after the kernels that read it were queued on the current stream; the process
    group orders its communication stream after the current stream at every issue.
    """

    device: torch.device
    reuse: bool = True
    pool: dict[tuple[torch.dtype, tuple[int, ...]], list[torch.Tensor]] = field(default_factory=dict)
    allocated: int = 0
    reused: int = 0

    def take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A buffer to receive into: an alias of a free pooled one (the alias is what holds it taken), else new."""
        kept = self.pool.setdefault((dtype, shape), [])
        if self.reuse:
            for buffer in kept:
                if _storage_refs(buffer) == _ONLY_THE_POOL:
                    self.reused += 1
                    return buffer.detach()
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        self.allocated += 1
        if self.reuse and _storage_refs(buffer) == _ONLY_THE_POOL:
            kept.append(buffer)
            return buffer.detach()
        return buffer

    def counts(self) -> dict[str, int]:
        return {"allocated": self.allocated, "reused": self.reused}


#: `_storage_refs` of a tensor nothing else holds: the tensor and the storage object of the call.
_ONLY_THE_POOL = 2


class DistTransport:
    """torch.distributed P2P and collectives. Call after `init_process_group`, on every rank alike.

    The first message of each (sender, receiver, tag) is a fixed-size int64 header (tag, kind, dtype,
    ndim, shape) followed by the payload, so the receiver needs no shape table. NCCL ignores tags, so
    the header's tag is also checked: a plan whose sends and recvs between two ranks come in different
    orders fails clearly (at its first step, and every step runs the same program). After that a
    tensor travels alone: both ends remember the first header, the receiver posts a buffer of that
    shape and the sender refuses a tensor whose shape or dtype changed, so one message per send is
    all the wire carries. Non-tensor payloads always carry their header (their length varies).
    """

    def __init__(self, groups: list[tuple[int, ...]], device: torch.device, *, reuse_buffers: bool = True) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = device
        self.buffers = ReceiveBuffers(device, reuse_buffers)
        """Where every tensor received lands: reused per shape once free (`ReceiveBuffers`), unless turned off."""
        self.on_stream = device.type == "cuda"
        """Waits order the current CUDA stream after the transfer instead of blocking the host (`_wait`)."""
        # new_group is collective: every rank creates every group, in the same (sorted) order.
        self.groups: dict[tuple[int, ...], Any] = {}
        # (peer, tag) -> (dtype, shape) of the tensor whose header went out / came in first.
        self.sent: dict[tuple[int, int], tuple[torch.dtype, tuple[int, ...]]] = {}
        self.received: dict[tuple[int, int], tuple[torch.dtype, tuple[int, ...]]] = {}
        for group in sorted(set(groups)):
            if len(group) > 1:
                self.groups[group] = dist.new_group(ranks=list(group))

    def isend(self, payload: Any, peer: int, tag: int) -> Pending:
        what = f"on rank {self.rank} sending tag {tag} to rank {peer}"
        known = self.sent.get((peer, tag))
        if isinstance(payload, torch.Tensor):
            body = self._tensor_body(payload, peer, tag)
            if known is not None:
                return _DistPending([dist.isend(body, peer, tag=tag)], [body], what, self.on_stream)
            if body.dim() > _MAX_DIMS:
                raise DappleError(f"cannot send a tensor of {body.dim()} dimensions (at most {_MAX_DIMS})")
            head = [tag, _KIND_TENSOR, _DTYPES.index(body.dtype), body.dim(), *body.shape]
            self.sent[(peer, tag)] = (body.dtype, tuple(body.shape))
        else:
            if known is not None:
                raise DappleError(
                    f"rank {self.rank} sends tag {tag} to rank {peer} as a {type(payload).__name__}, but earlier "
                    "as a tensor: a value crossing stages must keep its kind from step to step"
                )
            data = json.dumps(to_jsonable(payload)).encode()
            body = torch.tensor(list(data), dtype=torch.uint8, device=self.device)
            head = [tag, _KIND_JSON, _DTYPES.index(torch.uint8), 1, len(data)]
        header = torch.tensor(head + [0] * (_HEADER_LEN - len(head)), dtype=torch.int64).to(self.device)
        works = [dist.isend(header, peer, tag=tag), dist.isend(body, peer, tag=tag)]
        return _DistPending(works, [header, body], what, self.on_stream)

    def _tensor_body(self, payload: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
        """The tensor as it goes on the wire, refused when its shape or dtype differs from its first send."""
        body = payload.detach().contiguous().to(self.device)
        known = self.sent.get((peer, tag))
        if known is not None and known != (body.dtype, tuple(body.shape)):
            raise DappleError(
                f"rank {self.rank} sends tag {tag} to rank {peer} as a {body.dtype} tensor of shape "
                f"{list(body.shape)}, but earlier as {known[0]} of shape {list(known[1])}: a value crossing "
                "stages must keep its shape and dtype from step to step (static shapes)"
            )
        return body

    def exchange(
        self, sends: list[tuple[Any, int, int]], recvs: list[tuple[int, int]]
    ) -> tuple[list[Pending], list[PendingRecv]]:
        """Sends and receives issued together. On NCCL, once every message's header has travelled, as one
        group (`batch_isend_irecv`: a send and a receive with the same peer run concurrently, in one launch);
        the receives are then posted here, not deferred as `irecv` defers them. On gloo, whose batches are
        plain loops, one by one."""
        ready = all(isinstance(p, torch.Tensor) and (peer, tag) in self.sent for p, peer, tag in sends) and all(
            key in self.received for key in recvs
        )
        if not self.on_stream or not ready or len(sends) + len(recvs) < 2:
            return exchange_each(self, sends, recvs)
        ops, pending, posted = [], [], []
        for payload, peer, tag in sends:
            body = self._tensor_body(payload, peer, tag)
            ops.append(dist.P2POp(dist.isend, body, peer, tag=tag))
            pending.append((body, f"on rank {self.rank} sending tag {tag} to rank {peer}"))
        for peer, tag in recvs:
            buffer = self.buffers.take(*self.received[(peer, tag)])
            ops.append(dist.P2POp(dist.irecv, buffer, peer, tag=tag))
            posted.append((peer, tag, buffer))
        # NCCL may answer a coalesced group with one work for all of it: every handle waits on them all
        # (on the stream, so waiting on more than its own costs nothing the group does not cost anyway).
        works = dist.batch_isend_irecv(ops)
        sent: list[Pending] = [_DistPending(works, [body], what, True) for body, what in pending]
        received: list[PendingRecv] = [_PostedBody(self, peer, tag, buffer, works) for peer, tag, buffer in posted]
        return sent, received

    def irecv(self, peer: int, tag: int) -> PendingRecv:
        """Post the receive now: into a buffer of the known shape (`ReceiveBuffers`) when this (peer, tag) has
        been seen before, else its header."""
        if self.on_stream:
            # NCCL runs a pair's sends and receives on one stream in issue order: a receive posted ahead of a
            # send the peer needs first would block that send. The host runs ahead of the GPU anyway (every
            # wait is a stream wait), so receiving at the use still has the transfer queued early on the GPU.
            return _Later(self, peer, tag)
        return self._post(peer, tag)

    def recv(self, peer: int, tag: int, timeout: float) -> Any:
        return self._post(peer, tag).wait(timeout)

    def _post(self, peer: int, tag: int) -> PendingRecv:
        known = self.received.get((peer, tag))
        if known is not None:
            body = self.buffers.take(*known)
            return _PostedBody(self, peer, tag, body, dist.irecv(body, peer, tag=tag))
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self.device)
        return _PostedHeader(self, peer, tag, header, dist.irecv(header, peer, tag=tag))

    def _what(self, peer: int, tag: int) -> str:
        return f"on rank {self.rank} receiving tag {tag} from rank {peer}"

    def _body(self, peer: int, tag: int, header: torch.Tensor, timeout: float) -> Any:
        """The payload a first message's header announces (read on the host: once per (peer, tag) per run)."""
        head = header.cpu().tolist()
        if head[0] != tag:
            raise DappleError(
                f"rank {self.rank} expected the message with tag {tag} from rank {peer} but got tag {head[0]}: "
                "the two ranks' programs send and receive in different orders"
            )
        kind, dtype, ndim = head[1], _DTYPES[head[2]], head[3]
        shape = tuple(head[4 : 4 + ndim])
        body = (
            self.buffers.take(dtype, shape)
            if kind == _KIND_TENSOR
            else torch.empty(shape, dtype=dtype, device=self.device)
        )
        _wait(dist.irecv(body, peer, tag=tag), timeout, self._what(peer, tag))
        if kind == _KIND_TENSOR:
            self.received[(peer, tag)] = (dtype, shape)
            return body
        return from_jsonable(json.loads(bytes(body.cpu().tolist()).decode()))

    def allreduce(self, tensor: torch.Tensor, group: tuple[int, ...], timeout: float) -> None:
        if len(group) < 2:
            return
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.groups[group], async_op=True)
        _wait(work, timeout, f"on rank {self.rank} in allreduce over ranks {list(group)}", self.on_stream)

    def reduce_scatter(self, tensor: torch.Tensor, group: tuple[int, ...], timeout: float) -> None:
        if len(group) < 2:
            return
        what = f"on rank {self.rank} in reduce_scatter over ranks {list(group)}"
        if self._native_shards(group):
            mine = tensor.chunk(len(group))[group.index(self.rank)]
            work = dist.reduce_scatter_tensor(
                mine, tensor, op=dist.ReduceOp.SUM, group=self.groups[group], async_op=True
            )
        else:
            # gloo has no reduce-scatter: an allreduce, of which each member keeps its chunk (the same bits and
            # traffic as the allreduce a stage without sharded state runs).
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.groups[group], async_op=True)
        _wait(work, timeout, what, self.on_stream)

    def all_gather(self, tensor: torch.Tensor, group: tuple[int, ...], timeout: float) -> None:
        if len(group) < 2:
            return
        what = f"on rank {self.rank} in all_gather over ranks {list(group)}"
        chunks = list(tensor.chunk(len(group)))
        mine = chunks[group.index(self.rank)]
        if self._native_shards(group):
            work = dist.all_gather_into_tensor(tensor, mine, group=self.groups[group], async_op=True)
        else:
            work = dist.all_gather(chunks, mine.clone(), group=self.groups[group], async_op=True)
        _wait(work, timeout, what, self.on_stream)

    def _native_shards(self, group: tuple[int, ...]) -> bool:
        """Whether the group's backend has reduce_scatter_tensor and all_gather_into_tensor (NCCL)."""
        return str(dist.get_backend(self.groups[group])) == "nccl"

    def finish(self, timeout: float) -> None:
        """Wait (bounded) until every rank is done, so nobody tears down while a peer still receives."""
        work = dist.all_reduce(torch.zeros(1, device=self.device), async_op=True)
        _wait(work, timeout, f"on rank {self.rank} waiting for the other ranks to finish")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
