"""A dynamic kernel's entry in TorchRec's `model.fused_optimizer`.

TorchRec gathers one FusedOptimizer per FusedOptimizerModule kernel into
`model.fused_optimizer` (a CombinedOptimizer), which training code puts
beside its dense optimizer and hands to LR schedulers (torch's, TorchRec's
WarmupOptimizer). FBGEMM's EmbeddingFusedOptimizer is a FUSED table's: its
param group's "lr" goes to the TBE at every step() and zero_grad(). This is
the same for dynamic tables, so that one schedule drives native and dynamic
tables alike. It holds no state (and one empty placeholder parameter, for
its group's name): the rows and their optimizer state live in the tables
(model.state_dict(), dumps), so the optimizer's state_dict() adds nothing."""
from typing import Any, Dict

import torch
from torchrec.optim.fused import FusedOptimizer


class DynamicEmbFusedOptimizer(FusedOptimizer):
    def __init__(self, emb_module) -> None:
        self._emb_module = emb_module
        # TorchRec's KeyedOptimizer tells param groups apart by the names of
        # their parameters (a load restores each group's saved "lr" by them):
        # a placeholder named after the group's tables (empty, no gradient,
        # no state). With none, every dynamic group had the same name, and a
        # load gave all of them one group's lr.
        placeholder = torch.empty(0)
        key = "dynamicemb:" + ",".join(emb_module.table_names)
        super().__init__({key: placeholder}, {}, [{"params": [placeholder], "lr": emb_module.get_learning_rate()}])

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._emb_module.set_learning_rate(self.param_groups[0]["lr"])

    def step(self, closure: Any = None) -> None:
        self._emb_module.set_learning_rate(self.param_groups[0]["lr"])

    def set_optimizer_step(self, step: int) -> None:
        self._emb_module.set_optimizer_step(step)

    # As FBGEMM's: the tables take the values now; the group's "lr" stays
    # what step() and zero_grad() set (so a FUSED table and a dynamic one of
    # one model follow the same rates).
    def update_hyper_parameters(self, params_dict: Dict[str, Any]) -> None:
        self._emb_module.update_hyper_parameters(params_dict)
