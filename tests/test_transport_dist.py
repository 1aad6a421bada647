"""DistTransport over a real gloo process group of two processes on 127.0.0.1.

The wire protocol: the first message of a (sender, receiver, tag) carries a header, later tensors
travel alone into a buffer of the remembered shape. What rank 1 receives must equal what rank 0
sent, step after step, and a tensor whose shape changes between steps is refused by its sender.
"""

from __future__ import annotations

import datetime
import os
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dapple_ir.backends.torch.launch import free_port
from dapple_ir.backends.torch.transport import DistTransport
from dapple_ir.errors import DappleError

pytestmark = pytest.mark.slow

TIMEOUT = 30.0


def _payloads(step: int) -> list[object]:
    g = torch.Generator().manual_seed(step)
    return [
        torch.randn(4, 3, generator=g),
        torch.randint(0, 9, (5,), generator=g),
        (step, 2, "x"),  # a non-tensor payload: JSON with its header every time
        torch.randn(2, 2, 2, generator=g).double(),
    ]


def _gloo_rank(body: Callable[[int, DistTransport, list[str]], None], rank: int, port: int, out: str) -> None:
    """One of two gloo ranks on 127.0.0.1: `body` fills the lines that rank_<r>.txt gets (or the traceback)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT))
    lines: list[str] = []
    try:
        body(rank, DistTransport([], torch.device("cpu")), lines)
    except Exception:
        lines.append(traceback.format_exc())
    finally:
        Path(out, f"rank_{rank}.txt").write_text("\n".join(lines))
        dist.destroy_process_group()


def run_two_ranks(body: Callable[[int, DistTransport, list[str]], None], out: Path) -> list[list[str]]:
    """Run `body` (a module-level function: spawn pickles it) on two gloo ranks; each rank's lines."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(body, r, port, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank did not finish within 120 s"
    return [(out / f"rank_{r}.txt").read_text().splitlines() for r in range(2)]


def _headers(rank: int, transport: DistTransport, lines: list[str]) -> None:
    for step in range(3):
        for tag, payload in enumerate(_payloads(step)):
            if rank == 0:
                transport.isend(payload, 1, tag).wait(TIMEOUT)
            else:
                got = transport.recv(0, tag, TIMEOUT)
                same = torch.equal(got, payload) if isinstance(payload, torch.Tensor) else got == payload
                lines.append(f"{step} {tag} {same} {type(got).__name__}")
    if rank == 0:
        try:
            transport.isend(torch.zeros(4, 4), 1, 0)
        except DappleError as exc:
            lines.append(f"refused: {exc}")
    lines.append(f"headers remembered: {len(transport.sent) + len(transport.received)}")


def test_header_goes_once_per_tag_and_shapes_are_held(tmp_path: Path) -> None:
    sender, receiver = run_two_ranks(_headers, tmp_path)
    # Every payload arrived intact at every step: the header-less steps put the bytes in the right shape.
    expected = [f"{s} {t} True {'tuple' if t == 2 else 'Tensor'}" for s in range(3) for t in range(4)]
    assert receiver[:-1] == expected, receiver
    # Three tensor tags are remembered at each end; the JSON tag is not (it always carries a header).
    assert receiver[-1] == "headers remembered: 3"
    assert sender[-1] == "headers remembered: 3"
    refused = sender[0]
    assert refused.startswith("refused: rank 0 sends tag 0 to rank 1 as a torch.float32 tensor of shape [4, 4]")
    assert "earlier as torch.float32 of shape [4, 3]" in refused and "static shapes" in refused


# ------------------------------------------------------------------------------ receive buffers reused


def _reuse(rank: int, transport: DistTransport, lines: list[str]) -> None:
    sent = [torch.full((3, 4), float(k)) for k in range(5)]
    if rank == 0:
        for tensor in sent:
            transport.isend(tensor, 1, 5).wait(TIMEOUT)
        return
    held = transport.recv(0, 5, TIMEOUT)  # the first message (its header, then the body): the pool's first buffer
    second = transport.recv(0, 5, TIMEOUT)
    lines.append(f"held kept apart {held.data_ptr() != second.data_ptr()}")
    # Autograd saves the received tensor (through a detached leaf): its buffer stays taken while the graph lives.
    w = torch.ones(3, 4, requires_grad=True)
    loss = (second.detach().requires_grad_(True) * w).sum()
    ptr = second.data_ptr()
    del second
    third = transport.recv(0, 5, TIMEOUT)
    lines.append(f"saved kept apart {third.data_ptr() != ptr}")
    loss.backward()
    del loss, third
    fourth = transport.recv(0, 5, TIMEOUT)
    pooled = {t.data_ptr() for t in transport.buffers.pool[(torch.float32, (3, 4))]}
    lines.append(f"freed reused {fourth.data_ptr() in pooled - {held.data_ptr()}}")
    fifth = transport.recv(0, 5, TIMEOUT)
    lines.append(f"values {[float(t[0, 0]) for t in (held, fourth, fifth)]} {w.grad.sum().item()}")
    lines.append(f"counts {transport.buffers.counts()}")


def test_receive_buffers_are_reused_only_once_nothing_holds_them(tmp_path: Path) -> None:
    _, receiver = run_two_ranks(_reuse, tmp_path)
    assert receiver[:3] == ["held kept apart True", "saved kept apart True", "freed reused True"], receiver
    # Every payload landed whole in its buffer, reused or not; the graph's gradient read the second one's values.
    assert receiver[3] == "values [0.0, 3.0, 4.0] 12.0", receiver
    # Three buffers made (held, the graph's, the third); the fourth and fifth took freed ones.
    assert receiver[4] == "counts {'allocated': 3, 'reused': 2}", receiver
