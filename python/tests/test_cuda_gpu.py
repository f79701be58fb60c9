"""The engine on a CUDA device from PyTorch (ctest labels python and gpu; skipped, as a whole,
without a CUDA torch and a GPU zinf can use).

What it checks: zero-copy views (a parameter's data inside forward is zinf's device memory,
not torch's allocator's), the device budget beside torch's caching allocator (the engine
reserves what the config says, not 90% of the GPU), ordering against torch's current stream
(the results match a torch run), and the GPU Adam for sub-groups kept on the device.
"""
import copy

import pytest
import torch

import zinf
from conftest import make_config
from models import Gpt2, Llama, batch

if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device (a CPU build of torch, or no GPU)",
                allow_module_level=True)
if zinf._zinf.cuda_device_count() == 0:
    pytest.skip("zinf was built without CUDA or sees no GPU", allow_module_level=True)

MiB = 1 << 20


def train_pair(model_fn, cfg, steps=10):
    torch.manual_seed(1234)
    model = model_fn()
    ref = copy.deepcopy(model).cuda()
    p = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(ref.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                            weight_decay=p["weight_decay"])
    engine = zinf.initialize(model, cfg, device="cuda")
    for step in range(steps):
        ids, tgt = (t.cuda() for t in batch(step))
        loss = engine(ids, tgt)
        engine.backward(loss)
        engine.step()
        ref(ids, tgt).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    got, want = engine.full_state_dict(), ref.state_dict()
    return max((got[k] - want[k].cpu()).abs().max().item() for k in want), engine


@pytest.mark.parametrize("model_fn", [Llama, Gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("param,states", [("cpu", "cpu"), ("nvme", "nvme")])
def test_training_on_the_gpu_matches_torch(model_fn, param, states, scratch):
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = make_config(param, states, nvme=scratch, lr=3e-3, device_budget_bytes="256M")
    worst, _ = train_pair(model_fn, cfg)
    print("GPU: max |zinf - torch| after 10 steps (%s, %s/%s): %.3g"
          % (model_fn.__name__, param, states, worst))
    assert worst < 1e-5


def test_the_gpu_adam_steps_the_subgroups_kept_on_the_device(scratch):
    cfg = make_config("none", "cpu", lr=3e-3, device_budget_bytes="256M")
    cfg["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    worst, _ = train_pair(Llama, cfg)
    print("GPU Adam for half the sub-groups: max |zinf - torch| %.3g" % worst)
    assert worst < 1e-5


def test_views_are_zinf_memory_and_the_budget_is_what_the_config_says():
    free_before, _ = torch.cuda.mem_get_info()
    engine = zinf.initialize(Llama(), make_config(device_budget_bytes="300M"), device="cuda")
    free_after, _ = torch.cuda.mem_get_info()
    reserved = free_before - free_after
    assert 300 * MiB <= reserved < 300 * MiB + 64 * MiB, reserved
    seen = []
    handle = engine.module.lm_head.register_forward_pre_hook(
        lambda m, i: seen.append((m.weight.device.type, m.weight.data_ptr())))
    allocated = torch.cuda.memory_allocated()
    ids, tgt = (t.cuda() for t in batch(0))
    loss = engine(ids, tgt)
    handle.remove()
    assert seen and seen[0][0] == "cuda"
    # The weight lives in zinf's pool: no segment of torch's caching allocator holds it, and
    # torch allocated about nothing for it.
    ptr = seen[0][1]
    for seg in torch.cuda.memory_snapshot():
        assert not seg["address"] <= ptr < seg["address"] + seg["total_size"], seg
    assert torch.cuda.memory_allocated() - allocated < 8 * MiB
    engine.backward(loss)
    engine.step()


def test_fp16_trains_a_llama_on_the_gpu_as_fp32_does(scratch):
    # fp16 with dynamic loss scaling, computing in float16 on the GPU (test_fp16.py checks the
    # scaler's behaviour exactly on the host device): the loss falls as fp32's does.
    runs = {}
    for fp16 in (False, True):
        torch.manual_seed(1234)
        cfg = make_config("cpu", "cpu", lr=3e-3, device_budget_bytes="256M")
        cfg["fp16"] = {"enabled": fp16, "initial_scale_power": 16}
        engine = zinf.initialize(Llama(), cfg, device="cuda")
        losses = []
        for step in range(30):
            ids, tgt = (t.cuda() for t in batch(step))
            loss = engine(ids, tgt)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        if fp16:
            assert engine.module.lm_head.weight.dtype == torch.float16
        runs[fp16] = (losses, engine.skipped_steps)
    (l32, _), (l16, skipped) = runs[False], runs[True]
    print("GPU fp16: %d steps skipped; last losses fp16 %s, fp32 %s"
          % (skipped, l16[-3:], l32[-3:]))
    assert skipped < 10 and all(x == x and abs(x) != float("inf") for x in l16)
    end16, end32 = sum(l16[-5:]) / 5, sum(l32[-5 - skipped:len(l32) - skipped]) / 5
    assert end16 < 0.9 * l16[0] and abs(end16 - end32) <= 0.05 * end32, (end16, end32)
