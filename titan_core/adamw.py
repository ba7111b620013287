"""AdamW whose two moments are stored in a narrower dtype than the parameters (bf16 states).

torch's AdamW keeps its moments in the parameters' dtype: 8 bytes per fp32 parameter. Stored in bf16
they take 4, a quarter of a mixed-precision job's per-parameter memory (4 weights + 4 gradient + 8
states). The update itself is torch's AdamW, in fp32: each moment is widened, updated and rounded back.
One parameter at a time, so the fp32 temporaries never exceed the largest parameter (a foreach update
would widen every state at once and give back what storing them narrow saved).
"""

from __future__ import annotations

import torch


class AdamWNarrowStates(torch.optim.Optimizer):
    """Decoupled weight decay Adam (Loshchilov & Hutter) with ``exp_avg``/``exp_avg_sq`` in ``state_dtype``.

    The state dict has torch AdamW's keys (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints save,
    reshard and resume it like torch's AdamW.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 state_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.state_dtype)
                state["step"] += 1
                step = state["step"].item()
                grad = param.grad.float()
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(group["eps"])
                param.addcdiv_(exp_avg, denom, value=-group["lr"] / (1 - beta1**step))
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
        return loss
