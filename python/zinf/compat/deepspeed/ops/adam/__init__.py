"""deepspeed.ops.adam: DeepSpeedCPUAdam and FusedAdam as zinf reads them. Handed to
deepspeed.initialize they become zinf's Adam or AdamW (adamw_mode / adam_w_mode) with their
parameter groups; zinf's SIMD CPU kernel (or the GPU kernel) steps them inside engine.step().
Called directly (opt.step() outside an engine) they are torch's Adam / AdamW over the same
groups, so a script that uses one without initialize still trains."""
import torch

import zinf


class _ZinfAdam(torch.optim.Optimizer):
    def __init__(self, params, lr, betas, eps, weight_decay, adamw, amsgrad, bias_correction):
        if amsgrad:
            raise zinf.ZinfError("%s(amsgrad=True): zinf's Adam has no amsgrad"
                                 % type(self).__name__)
        if not bias_correction:
            raise zinf.ZinfError("%s(bias_correction=False): zinf's Adam always corrects the "
                                 "bias (as torch's)" % type(self).__name__)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay, "amsgrad": False,
                                  "maximize": False, "foreach": None, "capturable": False,
                                  "differentiable": False, "fused": False})
        self.adamw_mode = adamw
        self._zinf_kind = "AdamW" if adamw else "Adam"

    @torch.no_grad()
    def step(self, closure=None):
        # Outside a zinf engine: torch's step over the same groups and state.
        return (torch.optim.AdamW if self.adamw_mode else torch.optim.Adam).step(self, closure)


class DeepSpeedCPUAdam(_ZinfAdam):
    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        if not fp32_optimizer_states:
            raise zinf.ZinfError("DeepSpeedCPUAdam(fp32_optimizer_states=False): set "
                                 "zinf.optimizer_state_dtype \"bf16\" in the config instead")
        super().__init__(model_params, lr, betas, eps, weight_decay, adamw_mode, amsgrad,
                         bias_correction)


class FusedAdam(_ZinfAdam):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True):
        super().__init__(params, lr, betas, eps, weight_decay, adam_w_mode, amsgrad,
                         bias_correction)
