"""deepspeed.ops.lion: DeepSpeedCPULion / FusedLion as zinf reads them (zinf's Lion kernel
inside an engine; stepping one directly is refused: torch has no Lion)."""
import torch

import zinf


class DeepSpeedCPULion(torch.optim.Optimizer):
    def __init__(self, model_params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0,
                 fp32_optimizer_states=True, adamw_mode=None):
        super().__init__(model_params, {"lr": lr, "betas": tuple(betas),
                                        "weight_decay": weight_decay, "eps": 0.0})
        self._zinf_kind = "Lion"

    def step(self, closure=None):
        raise zinf.ZinfError("%s.step() outside a zinf engine: hand it to deepspeed.initialize "
                             "(zinf's Lion runs inside engine.step())" % type(self).__name__)


class FusedLion(DeepSpeedCPULion):
    pass
