"""How ranks exchange tensors: torch.distributed (gloo on CPU, NCCL on CUDA) or threads in one process.

Both transports offer the same four operations: `isend` (non-blocking), `recv` (blocking, bounded by a
timeout), `allreduce` (sum over a group of ranks, in place) and `close`. A payload is a tensor or a
small non-tensor value (an int from `size()`, a tuple of ints, a float, a bool, None); non-tensors
travel as JSON text, never pickled. Every wait has a timeout; a wait that runs out, or a peer that
failed, raises `TransportError`, which the launcher treats as a consequence of another rank's
failure rather than a cause.
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


class Transport(Protocol):
    """What the runtime needs from a transport."""

    rank: int
    world: int

    def isend(self, payload: Any, peer: int, tag: int) -> Pending: ...

    def recv(self, peer: int, tag: int, timeout: float) -> Any: ...

    def allreduce(self, tensor: torch.Tensor, group: tuple[int, ...], timeout: float) -> None: ...

    def close(self) -> None: ...


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

    def recv(self, peer: int, tag: int, timeout: float) -> Any:
        with self.hub.cond:
            box = self.hub.mail.setdefault((peer, self.rank, tag), deque())
            self.hub.wait_for(lambda: bool(box), timeout, f"on rank {self.rank} receiving tag {tag} from rank {peer}")
            return box.popleft()

    def allreduce(self, tensor: torch.Tensor, group: tuple[int, ...], timeout: float) -> None:
        if len(group) < 2:
            return
        call = self.calls.get(group, 0)
        self.calls[group] = call + 1
        key = (group, call)
        what = f"on rank {self.rank} in allreduce over ranks {list(group)}"
        with self.hub.cond:
            self.hub.slots.setdefault(key, {})[self.rank] = tensor.detach().clone()
            if len(self.hub.slots[key]) == len(group):
                parts = self.hub.slots.pop(key)
                # Summing in group order makes every participant get the very same bits.
                total = parts[group[0]].clone()
                for r in group[1:]:
                    total += parts[r]
                self.hub.results[key] = (total, set())
                self.hub.cond.notify_all()
            self.hub.wait_for(lambda: key in self.hub.results, timeout, what)
            total, readers = self.hub.results[key]
            tensor.copy_(total)
            readers.add(self.rank)
            if len(readers) == len(group):
                del self.hub.results[key]

    def close(self) -> None:
        return None


# ------------------------------------------------------------------------------ torch.distributed


@dataclass
class _DistPending:
    works: list[Any]
    keep: list[torch.Tensor]
    what: str

    def wait(self, timeout: float) -> None:
        for work in self.works:
            _wait(work, timeout, self.what)


def _wait(work: Any, timeout: float, what: str) -> None:
    try:
        ok = work.wait(timedelta(seconds=timeout))
    except Exception as exc:  # gloo raises on timeouts and on peers that closed their socket
        raise TransportError(f"{what} failed: {_first_line(exc)}") from exc
    if ok is False:
        raise TransportError(f"timed out after {timeout:g} s {what}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


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

    def __init__(self, groups: list[tuple[int, ...]], device: torch.device) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = device
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
            body = payload.detach().contiguous().to(self.device)
            if known is not None:
                if known != (body.dtype, tuple(body.shape)):
                    raise DappleError(
                        f"rank {self.rank} sends tag {tag} to rank {peer} as a {body.dtype} tensor of shape "
                        f"{list(body.shape)}, but earlier as {known[0]} of shape {list(known[1])}: a value crossing "
                        "stages must keep its shape and dtype from step to step (static shapes)"
                    )
                return _DistPending([dist.isend(body, peer, tag=tag)], [body], what)
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
        return _DistPending(works, [header, body], what)

    def recv(self, peer: int, tag: int, timeout: float) -> Any:
        what = f"on rank {self.rank} receiving tag {tag} from rank {peer}"
        known = self.received.get((peer, tag))
        if known is not None:
            body = torch.empty(known[1], dtype=known[0], device=self.device)
            _wait(dist.irecv(body, peer, tag=tag), timeout, what)
            return body
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self.device)
        _wait(dist.irecv(header, peer, tag=tag), timeout, what)
        head = header.cpu().tolist()
        if head[0] != tag:
            raise DappleError(
                f"rank {self.rank} expected the message with tag {tag} from rank {peer} but got tag {head[0]}: "
                "the two ranks' programs send and receive in different orders"
            )
        kind, dtype, ndim = head[1], _DTYPES[head[2]], head[3]
        body = torch.empty(head[4 : 4 + ndim], dtype=dtype, device=self.device)
        _wait(dist.irecv(body, peer, tag=tag), timeout, what)
        if kind == _KIND_TENSOR:
            self.received[(peer, tag)] = (dtype, tuple(head[4 : 4 + ndim]))
            return body
        return from_jsonable(json.loads(bytes(body.cpu().tolist()).decode()))

    def allreduce(self, tensor: torch.Tensor, group: tuple[int, ...], timeout: float) -> None:
        if len(group) < 2:
            return
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.groups[group], async_op=True)
        _wait(work, timeout, f"on rank {self.rank} in allreduce over ranks {list(group)}")

    def finish(self, timeout: float) -> None:
        """Wait (bounded) until every rank is done, so nobody tears down while a peer still receives."""
        work = dist.all_reduce(torch.zeros(1, device=self.device), async_op=True)
        _wait(work, timeout, f"on rank {self.rank} waiting for the other ranks to finish")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
