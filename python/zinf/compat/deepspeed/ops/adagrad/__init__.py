"""deepspeed.ops.adagrad: DeepSpeedCPUAdagrad as zinf reads it (zinf's Adagrad)."""
import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """torch's Adagrad over the groups when stepped directly; zinf's Adagrad kernel inside an
    engine. accelerate passes adamw_mode to every CPU optimizer; Adagrad has no such mode."""

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False,
                 fp32_optimizer_states=True, adamw_mode=None):
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
        self._zinf_kind = "Adagrad"
