"""The optimizer's end of a training step on one rank: Runtime's base class.

Once a step's gradients are final: loss scaling's unscale and inf check, clipping's norm over
every training rank, optimizer.step() (under ZeRO bucket by bucket), zero_grad and the LR
scheduler; and, when a step starts, the gradients it owns cleared. The methods read the
Runtime's fields (optimizer, lr_scheduler, grad_scaler, found_inf, masters, zero, device,
executors, owned, kept_grads); the run entries that call them (`_run_optimizer_step`,
`_run_clip_grad_norm`) stay with the others in runtime/actors.py.
"""
from __future__ import annotations

from typing import Dict

import torch

from .. import world
from ..ops.conversions import all_reduce_sum
from ..plan.instructions import ClipGradNorm


class OptimizerRunner:
    """Runtime's optimizer-side methods (See the module docstring)."""

    def _clip_grad_norm(self, ins: ClipGradNorm) -> None:
        """clip_grad_norm_ over the whole model: this rank's share of the squared norm, summed
        over every training rank, then every local gradient scaled (see insert_grad_clip)."""
        params = self._grad_holders()
        grads = [g for g in (params[n].grad for n in ins.params) if g is not None]
        dtype = getattr(torch, ins.tensors[0].dtype)
        sq = torch.zeros((), dtype=dtype, device=self.device)
        if grads:
            sq = torch.stack([torch.linalg.vector_norm(g, 2).to(dtype) for g in grads]).square().sum()
        norm = all_reduce_sum(sq, (ins.ranks,)).sqrt()
        coef = (ins.max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch: no host sync
        for p in {id(p): p for p in params.values()}.values():  # a tie held twice: scaled once
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))

    def _grad_holders(self) -> Dict[str, torch.nn.Parameter]:
        """This rank's parameters by name, whose .grad the optimizer steps on: a ZeRO
        parameter's shard in its place (See NOTE: ZeRO)."""
        params = local_parameters([ex.program for ex in self.executors.values()])
        if self.masters is not None:  # a bf16 parameter's gradient is its master's
            params = {n: self.masters.master_of(p) for n, p in params.items()}
        if self.zero is not None:
            params.update({n: s.shard for n, s in self.zero.by_name.items()})
        return params

    def _own_grads(self) -> None:
        """NOTE: The graph owns .grad. With an optimizer, a step starts from no gradients, as
        an eager loop's zero_grad() before backward: a .grad left by code outside the graph
        (an eager sanity backward, a gradient-norm diagnostic between calls) would otherwise
        be added into this step's. Without an optimizer, gradients accumulate over calls as
        eager's backward() does, for the user to read and clear. (The last step's gradients,
        kept since its zero_grad on a CPU, are let go here: NOTE: Gradients freed at the next
        step.)"""
        self.kept_grads = []
        masters = self.masters.masters() if self.masters is not None else []
        for p in self.owned + masters:
            p.grad = None

    def _unscale(self) -> None:
        """NOTE: Loss scaling. This rank's gradients times 1/scale, and whether any rank or
        stage found inf/NaN (one MAX all-reduce over the world); once per step."""
        if self.grad_scaler is None or self.found_inf is not None:
            return
        inv = self.grad_scaler.inverse()
        # on the rank's device: NCCL reduces a GPU tensor; a CPU one (a rank without gradients)
        # would go to gloo while the others' go to NCCL, and the MAX would never meet
        found = torch.zeros((), dtype=torch.float32, device=self.device)
        params = self._grad_holders()
        for p in {id(p): p for p in params.values()}.values():
            if p.grad is not None:
                p.grad.mul_(inv.to(p.grad.dtype))
                found = torch.maximum(found, (~torch.isfinite(p.grad)).any().float())
        everyone = world.multi()
        if everyone is not None:
            everyone.all_reduce(found, op="max")
        self.found_inf = bool(found)

    def _optimizer_step(self) -> None:
        if self.optimizer is None:
            return
        if self.grad_scaler is not None:
            self._unscale()
            if not self.found_inf:
                self._step()
            self.grad_scaler.update(self.found_inf)
        else:
            self._step()
        if self.device.type == "cpu":   # NOTE: Gradients freed at the next step
            self.kept_grads = [p.grad for group in self.optimizer.param_groups for p in group["params"]]
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()


    def _step(self) -> None:
        """optimizer.step(); under ZeRO bucket by bucket, each ALL_GATHER launched as soon as
        its rows are stepped (See NOTE: ZeRO step overlap in zero.py)."""
        if self.zero is None:
            self.optimizer.step()
        else:
            self.zero.step(self.optimizer, self.zero.after_step)
        if self.masters is not None:   # the parameters: the stepped masters, rounded (ZeRO's rows: gathered)
            self.masters.copy_back()


def local_parameters(programs) -> Dict[str, torch.nn.Parameter]:
    """Every parameter of this rank's stage programs by name (names are the user's: two chunks
    holding a parameter hold the same object)."""
    out: Dict[str, torch.nn.Parameter] = {}
    for prog in programs:
        for name, p in prog.module.named_parameters(remove_duplicate=False):
            out.setdefault(name, p)
    return out
