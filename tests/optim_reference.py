"""A float64 Python model of the fused optimizers, written from FBGEMM's
definitions (fbgemm_gpu/codegen/genscript/optimizers.py: the CUDA codegen is
the spec where its CPU TBE has no kernel), for tests to compare against.

Rows are kept per key as [weights (D) | optimizer state] in our layout
(ADAGRAD: D sums; ROWWISE_ADAGRAD: 1; ADAM: m1 (D), m2 (D);
PARTIAL_ROWWISE_ADAM: m1 (D), v (1); LAMB: m1 (D), m2 (D)). A step takes each key's gradient
summed over the batch (as a TBE reduces it) and applies the rule. FBGEMM's
gradient_clipping clamps the output gradient before that sum (each bag's
pooled gradient): callers sum clip(output gradient). Decay modes: NONE only
(weight_decay is the ADAM family's decoupled-in-update term)."""
from typing import Dict

import torch

STATE = {  # optimizer name -> state width for dim D
    "EXACT_SGD": lambda D: 0,
    "EXACT_ADAGRAD": lambda D: D,
    "EXACT_ROWWISE_ADAGRAD": lambda D: 1,
    "ADAM": lambda D: 2 * D,
    "PARTIAL_ROWWISE_ADAM": lambda D: D + 1,
    "LAMB": lambda D: 2 * D,
}
ACCUMULATORS = ("EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD")


class ReferenceOptimizer:
    def __init__(self, name: str, dim: int, lr: float = 0.01, eps: float = 1e-8, beta1: float = 0.9,
                 beta2: float = 0.999, weight_decay: float = 0.0, initial_accumulator_value: float = 0.0):
        self.name, self.D = name, dim
        self.lr, self.eps, self.b1, self.b2, self.wd = lr, eps, beta1, beta2, weight_decay
        self.init_acc = initial_accumulator_value if name in ACCUMULATORS else 0.0
        self.rows: Dict[int, torch.Tensor] = {}
        self.t = 0  # updates so far (the module's optimizer_step: one per backward)

    def add(self, key: int, weights: torch.Tensor) -> None:
        """A new row: its weights, its state at its start."""
        state = torch.full((STATE[self.name](self.D),), self.init_acc, dtype=torch.float64)
        self.rows[key] = torch.cat([weights.to(torch.float64).flatten(), state])

    def step(self, grads: Dict[int, torch.Tensor]) -> None:
        """One update: grads[key] is the key's gradient summed over the batch."""
        self.t += 1
        for key, g in grads.items():
            g = g.to(torch.float64)
            self.rows[key] = self._update(self.rows[key].clone(), g)

    def _update(self, row: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        D, t = self.D, self.t
        w, s = row[:D], row[D:]
        if self.name == "EXACT_SGD":
            w -= self.lr * g
        elif self.name == "EXACT_ADAGRAD":
            s += g * g
            w -= self.lr * g / (s.sqrt() + self.eps)
        elif self.name == "EXACT_ROWWISE_ADAGRAD":
            s += (g * g).mean()
            w -= self.lr * g / (s.sqrt() + self.eps)
        elif self.name == "ADAM":
            m1, m2 = s[:D], s[D:]
            m1.mul_(self.b1).add_((1 - self.b1) * g)
            m2.mul_(self.b2).add_((1 - self.b2) * g * g)
            upd = m1 / (1 - self.b1 ** t) / ((m2 / (1 - self.b2 ** t)).sqrt() + self.eps)
            w -= self.lr * (upd + self.wd * w)
        elif self.name == "PARTIAL_ROWWISE_ADAM":
            m1, v = s[:D], s[D:]
            v.mul_(self.b2).add_((1 - self.b2) * (g * g).mean())
            m1.mul_(self.b1).add_((1 - self.b1) * g)
            upd = m1 / (1 - self.b1 ** t) / ((v / (1 - self.b2 ** t)).sqrt() + self.eps)
            w -= self.lr * (upd + self.wd * w)
        elif self.name == "LAMB":
            m1, m2 = s[:D], s[D:]
            m1.mul_(self.b1).add_((1 - self.b1) * g)
            m2.mul_(self.b2).add_((1 - self.b2) * g * g)
            r = m1 / (1 - self.b1 ** t) / ((m2 / (1 - self.b2 ** t)).sqrt() + self.eps) + self.wd * w
            ratio = w.norm() / r.norm() if r.norm() > 0 else 0.0  # FBGEMM: NaN where ||r|| = 0
            w -= self.lr * ratio * r
        else:
            raise ValueError(name_error(self.name))
        return row


def name_error(name: str) -> str:
    return f"no reference for optimizer {name}"
