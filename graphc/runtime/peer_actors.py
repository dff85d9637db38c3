"""The actors that move tensors between ranks: one receive actor and one send actor per peer.

Receive actors run ahead of compute: each keeps up to `window` receives posted (its
buffers), so a transfer overlaps the compute before the one that needs it. Send actors post
a send as soon as compute has produced its tensors and hold them until the transfer
completes. The compute actor (actors.Runtime) takes from and posts to them in plan order.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from ..plan.instructions import Recv, Send

class RecvActor:
    """Posts the receives from one peer in plan order, at most `window` ahead of use."""

    def __init__(self, peer: int, recvs: List[Recv], p2p, device, window: int):
        self.peer, self.queue, self.p2p, self.device, self.window = peer, recvs, p2p, device, window
        self.posted: Dict[int, Tuple[Dict[str, torch.Tensor], list]] = {}
        self.next_post = self.next_take = self.tag = 0

    def pump(self) -> None:
        while self.next_post < len(self.queue) and self.next_post - self.next_take < self.window:
            ins = self.queue[self.next_post]
            bufs, works = {}, []
            for spec in ins.tensors:
                buf = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=self.device)
                works.append(self.p2p.irecv(buf, self.peer, self.tag))
                self.tag += 1
                bufs[spec.name] = buf
            self.posted[self.next_post] = (bufs, works)
            self.next_post += 1

    def take(self, ins: Recv) -> Dict[str, torch.Tensor]:
        k = self.next_take
        assert self.queue[k] == ins, f"receive actor for peer {self.peer} out of plan order"
        self.pump()
        bufs, works = self.posted.pop(k)
        for w in works:
            _wait(w, self.peer)
        self.next_take += 1
        self.pump()
        return bufs


class SendActor:
    """Posts the sends to one peer in plan order and keeps their tensors until done."""

    def __init__(self, peer: int, p2p):
        self.peer, self.p2p = peer, p2p
        self.inflight: List[Tuple[object, torch.Tensor]] = []
        self.tag = 0

    def post(self, ins: Send, tensors: Dict[str, torch.Tensor]) -> None:
        for spec in ins.tensors:
            t = tensors[spec.name].detach()
            if spec.is_piece:   # NOTE: Reshard pieces: only the rows the peer needs
                t = t[_window(spec)]
            t = t.contiguous()
            self.inflight.append((self.p2p.isend(t, self.peer, self.tag), t))
            self.tag += 1
        self.inflight = [(w, t) for w, t in self.inflight if not w.is_completed()]

    def drain(self) -> None:
        for w, _ in self.inflight:
            _wait(w, self.peer)
        self.inflight = []


def _window(spec) -> tuple:
    """The slices of a piece within its local tensor."""
    return tuple(slice(a, a + n) for a, n in zip(spec.at, spec.shape))


def _assemble(ins: Recv, got: Dict[str, torch.Tensor], assembling: dict) -> Dict[str, torch.Tensor]:
    """A value received in pieces (NOTE: Reshard pieces) is put together in one tensor of its
    local shape: the first piece's receive returns that tensor (the compute that reads it
    comes after every piece's receive in the plan), later pieces fill it in and return
    nothing more."""
    out = {}
    for spec in ins.tensors:
        if not spec.is_piece:
            out[spec.name] = got[spec.name]
            continue
        key = (ins.stage, ins.microbatch, ins.direction, ins.peer_stage, spec.name)
        if key not in assembling:
            whole = got[spec.name].new_empty(spec.of)
            assembling[key] = [whole, whole.numel()]
            out[spec.name] = whole
        entry = assembling[key]
        entry[0][_window(spec)] = got[spec.name]
        entry[1] -= got[spec.name].numel()
        if entry[1] <= 0:       # complete: the step's values keep it from here
            del assembling[key]
    return out


def _wait(work, peer: int) -> None:
    """Waits for a transfer; a transport error records the peer (see NOTE: Failure propagation)."""
    try:
        work.wait()
    except RuntimeError as exc:
        exc.graphc_peer = peer
        raise
