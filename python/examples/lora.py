"""LoRA adapters (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models") for
zinf.models.Llama, written here so the example needs no peft: finetune.py --lora RANK uses them,
and python/tests/test_lora.py trains them against torch.

add_lora(model, rank, alpha, targets) replaces projections of every block by LoRALinear (the
base weight under its own name, so a base checkpoint still loads by name; the adapters as
`<projection>.lora_A` and `.lora_B`) and freezes everything else. Call it before
zinf.initialize (zinf fixes the trained set there); under zinf.Init it works as well (the
base's values were handed to zinf already; A and B are handed over as each LoRALinear is
built).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# --lora-targets names -> the projections of each block they adapt (module, attribute).
LORA_TARGETS = {"q": [("self_attn", "q_proj")], "k": [("self_attn", "k_proj")],
                "v": [("self_attn", "v_proj")], "o": [("self_attn", "o_proj")],
                "gate": [("mlp", "gate_proj")], "up": [("mlp", "up_proj")],
                "down": [("mlp", "down_proj")]}
LORA_TARGETS["mlp"] = LORA_TARGETS["gate"] + LORA_TARGETS["up"] + LORA_TARGETS["down"]


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trained low-rank update:
    y = x W^T + b + (x A^T) B^T * alpha / rank.

    Takes over the wrapped nn.Linear's `weight` and `bias` under their own names (a base
    checkpoint still loads by name) and adds `lora_A` (rank x in, kaiming-uniform as in the
    LoRA reference code) and `lora_B` (out x rank, zeros: the layer starts equal to the base).
    Under zinf.Init the base's parameters were handed to zinf already (they stay placeholders);
    A and B are handed over when this constructor returns. No dropout (deterministic)."""

    def __init__(self, base, rank, alpha):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / rank

    def forward(self, x):
        update = F.linear(F.linear(x, self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + update * self.scaling


def add_lora(model, rank, alpha, targets=("q", "v", "mlp")):
    """Replaces the `targets` projections of every block of a zinf.models.Llama by LoRALinear
    and freezes every other parameter (call it before zinf.initialize: zinf fixes the trained
    set there). Returns the adapters' parameters, in registration order."""
    where = []
    for t in targets:
        where += [w for w in LORA_TARGETS[t] if w not in where]
    adapters = []
    for block in model.layers:
        for module, attr in where:
            parent = getattr(block, module)
            lora = LoRALinear(getattr(parent, attr), rank, alpha)
            setattr(parent, attr, lora)
            adapters += [lora.lora_A, lora.lora_B]
    ids = {id(p) for p in adapters}
    for p in model.parameters():
        p.requires_grad_(id(p) in ids)
    return adapters
