"""Activation checkpointing under zinf: torch.utils.checkpoint in both modes (reentrant,
torch 1.13's default, and non-reentrant) and zinf.checkpoint with the boundary activations
kept in memory, in host memory or on NVMe train like torch's own checkpointed model (the
parameters are fetched again in the recomputation); the offload really writes and reads
back (prefetched in reverse order) within its staging budget; the losses are identical
across the offload modes.

Tolerance: 1e-5 against torch AdamW, as test_parity.py (the optimizers differ by an ulp per
update; recomputation is the same arithmetic, so the modes agree bit for bit with each other).
"""
import copy
import gc
import os

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

import zinf
from conftest import make_config
from models import Llama, batch

TOL = 1e-5


class Checkpointed(Llama):
    """The test Llama with every layer checkpointed by `how`: "reentrant" or "nonreentrant"
    (torch.utils.checkpoint) or "zinf" (zinf.checkpoint)."""

    def __init__(self, how, layers=3):
        super().__init__(layers=layers)
        self.how = how

    def forward(self, ids, targets=None):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            if self.how == "reentrant":
                x = torch_checkpoint.checkpoint(layer, x)  # torch 1.13's default
            elif self.how == "nonreentrant":
                x = torch_checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = zinf.checkpoint(layer, x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def train(how, cfg, steps=5, gas=1):
    """zinf against torch (the same model with torch's reentrant checkpoint, AdamW)."""
    torch.manual_seed(42)
    model = Checkpointed(how)
    ref = copy.deepcopy(model)
    ref.how = "reentrant" if how != "nonreentrant" else "nonreentrant"
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    engine = zinf.initialize(model, cfg, device="cpu")
    losses = []
    for step in range(steps):
        for micro in range(gas):
            ids, tgt = batch(step, micro)
            loss = engine(ids, tgt)
            engine.backward(loss)
            engine.step()
            (ref(ids, tgt) / gas).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    got, want = engine.full_state_dict(), ref.state_dict()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    return worst, losses, engine


@pytest.mark.parametrize("how", ["reentrant", "nonreentrant"])
def test_torch_checkpoint_in_both_modes_matches_torch(how, scratch):
    cfg = make_config("nvme", "nvme", nvme=scratch, lr=3e-3)
    worst, losses, _ = train(how, cfg)
    print("torch.utils.checkpoint (%s): max |zinf - torch| %.3g" % (how, worst))
    assert worst < TOL
    assert losses[-1] < losses[0]


def test_reentrant_checkpoint_with_accumulation_matches_torch(scratch):
    cfg = make_config("cpu", "nvme", nvme=scratch, lr=3e-3, gas=2)
    worst, _, _ = train("reentrant", cfg, steps=3, gas=2)
    assert worst < TOL


def offload_config(scratch, where, **extra):
    os.makedirs(scratch + "/swap", exist_ok=True)
    cfg = make_config("cpu", "nvme", nvme=scratch + "/swap", lr=3e-3)
    block = {"cpu_checkpointing": where == "cpu", "nvme_checkpointing": where == "nvme"}
    if where == "nvme":
        os.makedirs(scratch + "/act", exist_ok=True)
        block["nvme_path"] = scratch + "/act"
    block.update(extra)
    cfg["activation_checkpointing"] = block
    return cfg


def test_zinf_checkpoint_offload_modes_match_torch_and_each_other(scratch):
    results = {}
    for where in ("memory", "cpu", "nvme"):
        os.makedirs(scratch + "/" + where)
        cfg = offload_config(scratch + "/" + where, where)
        worst, losses, engine = train("zinf", cfg)
        store = zinf._activations.current_store()
        results[where] = (worst, losses, dict(store.stats))
        print("zinf.checkpoint, boundaries in %s: max |zinf - torch| %.3g, %s"
              % (where, worst, store.stats))
        engine.close()
    for where, (worst, losses, stats) in results.items():
        assert worst < TOL, where
        assert losses == results["memory"][1], "the offload changes nothing in the arithmetic"
    nvme = results["nvme"][2]
    # 3 layers x 5 steps, each boundary 4 x 16 x 32 fp32 (8 KiB): written, then read back.
    assert nvme["boundary_bytes"] == nvme["nvme_written"] == nvme["nvme_read"] == 15 * 8192
    # Backward recomputes the last segment first (its input read on demand) and reads the
    # inputs of the two before it ahead of their recomputation.
    assert nvme["read_on_demand"] == 5 and nvme["prefetched"] == 10
    assert results["cpu"][2]["nvme_written"] == 0
    # The activations' swap folder goes with its store.
    assert [n for n in os.listdir(scratch + "/nvme/act") if n.startswith("zinf-activations-")]
    del store
    zinf._activations.configure(None)
    gc.collect()
    assert os.listdir(scratch + "/nvme/act") == []


def test_nvme_offload_cuts_tensors_to_its_staging_budget(scratch):
    """A 4 MiB budget: a boundary of 6 MiB goes out in 1 MiB chunks, and the loss and
    gradient are those of the unoffloaded segment."""
    cfg = offload_config(scratch, "nvme", buffer_bytes="4M")
    torch.manual_seed(3)
    lin = torch.nn.Linear(384, 384)
    model = torch.nn.Sequential(lin)
    ref = copy.deepcopy(lin)
    engine = zinf.initialize(model, cfg)
    x = torch.randn(4096, 384, requires_grad=True)  # 6 MiB
    y = zinf.checkpoint(lambda t: torch.tanh(model(t)), x)
    y.square().sum().backward()
    store = zinf._activations.current_store()
    assert store.stats["nvme_written"] == store.stats["nvme_read"] == 4096 * 384 * 4
    assert store._swap.peak_used <= 4 << 20
    x2 = x.detach().clone().requires_grad_()
    torch.tanh(ref(x2)).square().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    engine.step()


def test_activation_checkpointing_config_errors_name_the_key(scratch):
    bad = [({"cpu_checkpointing": True, "nvme_checkpointing": True}, "choose one"),
           ({"nvme_checkpointing": True, "nvme_path": scratch + "/missing"},
            "activation_checkpointing.nvme_path"),
           ({"cpu_checkpointing": "yes"}, "activation_checkpointing.cpu_checkpointing"),
           ({"buffer_bytes": "1K"}, "activation_checkpointing.buffer_bytes"),
           ({"prefetch": 2}, "activation_checkpointing.prefetch: unknown key")]
    for block, match in bad:
        cfg = make_config()
        cfg["activation_checkpointing"] = block
        with pytest.raises(zinf.ZinfError, match=match) as e:
            zinf.initialize(Llama(), cfg)
        assert e.value.code == "InvalidArgument"


def test_deepspeed_checkpointing_module_configures_the_same_store(scratch):
    import zinf as deepspeed
    deepspeed.checkpointing.configure(None, partition_activations=True, checkpoint_in_cpu=True)
    assert deepspeed.checkpointing.is_configured()
    assert zinf._activations.current_store().settings.where == "cpu"
    with pytest.raises(zinf.ZinfError, match="mpu_"):
        deepspeed.checkpointing.configure(object())
    deepspeed.checkpointing.configure(None)  # back to nothing offloaded
    assert zinf._activations.current_store().settings.where == "memory"
