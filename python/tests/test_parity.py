"""zinf against torch: the same model trained with zinf (parameters and optimizer states on
every tier) and with torch.optim.AdamW in memory, same seed and data, 20 steps: every
parameter within 1e-5 of torch's.

Why 1e-5 and not bit-identical: zinf's AdamW kernel and torch's evaluate the same formula in a
different order of fp32 operations (torch divides by sqrt(bias_correction2) after the square
root, multiplies the step size in separately; zinf folds the coefficients), so each update
differs from torch's by an ulp or so of the update (lr * ~1 = 1e-3, an ulp ~1e-10); the
gradient norm for clipping is summed in double by zinf and in fp32 by torch. Over 20 steps
these stay far below 1e-5 (the largest difference measured is printed and recorded in the
issue's note). Everything on the model side (forward, backward, the gradients' sums) is the
same torch code on the same values.
"""
import copy

import pytest
import torch

import zinf
from conftest import make_config
from models import Gpt2, Llama, Quirky, batch

TOL = 1e-5


def train_pair(model_fn, cfg, steps=20, gas=1, clip=0.0, schedule=None, quirky=False):
    torch.manual_seed(1234)
    model = model_fn()
    ref = copy.deepcopy(model)
    opt_cfg = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=opt_cfg["lr"],
                            betas=tuple(opt_cfg["betas"]), eps=opt_cfg["eps"],
                            weight_decay=opt_cfg["weight_decay"])
    engine = zinf.initialize(model, cfg, device="cpu")
    losses = []
    for step in range(steps):
        lr = schedule(step) if schedule else opt_cfg["lr"]
        engine.set_lr(lr)
        for group in opt.param_groups:
            group["lr"] = lr
        for micro in range(gas):
            ids, tgt = batch(step, micro)
            kw = {"use_aux": step % 3 == 0} if quirky else {}
            loss = engine(ids, tgt, **kw)
            engine.backward(loss)
            stats = engine.step()
            assert stats["optimizer_ran"] == (micro == gas - 1)
            ref_loss = ref(ids, tgt, **kw)
            (ref_loss / gas).backward()
            losses.append((loss.item(), ref_loss.item()))
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            assert stats["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
        opt.step()
        opt.zero_grad(set_to_none=True)  # torch skips parameters whose grad is None
    got = engine.full_state_dict()
    want = ref.state_dict()
    assert list(got) == list(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    return worst, losses, engine, ref


PLACEMENTS = [("cpu", "cpu"), ("cpu", "nvme"), ("nvme", "cpu"), ("nvme", "nvme")]


@pytest.mark.parametrize("model_fn", [Llama, Gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("param,states", PLACEMENTS, ids=["-".join(p) for p in PLACEMENTS])
def test_twenty_steps_match_torch_adamw(model_fn, param, states, scratch):
    cfg = make_config(param, states, nvme=scratch, lr=3e-3)
    worst, losses, engine, _ = train_pair(model_fn, cfg)
    print("max |zinf - torch| after 20 steps (%s, params %s, states %s): %.3g"
          % (model_fn.__name__, param, states, worst))
    assert worst < TOL
    assert losses[-1][0] < losses[0][0] - 0.5, "the model learns"
    assert engine.global_step == 20


@pytest.mark.parametrize("model_fn", [Llama, Gpt2], ids=["llama", "gpt2"])
def test_accumulation_clipping_and_schedule_match_torch(model_fn, scratch):
    def schedule(step):  # linear warmup over 5 steps, then cosine decay to 10%
        if step < 5:
            return 3e-3 * (step + 1) / 5
        return 3e-4 + 0.5 * (3e-3 - 3e-4) * (1 + torch.cos(torch.tensor((step - 5) / 15 * 3.14159)).item())

    cfg = make_config("nvme", "nvme", nvme=scratch, gas=2, clip=0.5)
    worst, _, _, _ = train_pair(model_fn, cfg, gas=2, clip=0.5, schedule=schedule)
    print("max |zinf - torch| with accumulation 2, clipping 0.5 and a schedule (%s): %.3g"
          % (model_fn.__name__, worst))
    assert worst < TOL


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_stages_below_3_match_torch(stage, scratch):
    """Stages 0 to 2 keep each parameter whole between steps (1 and 0 also sum the micro-steps'
    gradients locally): the same training as torch's AdamW."""
    cfg = make_config("cpu", "nvme", nvme=scratch, gas=2, lr=3e-3)
    cfg["zero_optimization"]["stage"] = stage
    worst, losses, engine, _ = train_pair(Llama, cfg, steps=10, gas=2)
    print("max |zinf - torch| at stage %d with accumulation 2: %.3g" % (stage, worst))
    assert worst < TOL
    assert losses[-1][0] < losses[0][0]


def test_frozen_repeated_and_unused_parameters_match_torch(scratch):
    """A frozen embedding (stored, never stepped), a module called twice per forward, and an
    auxiliary layer that gets a gradient only every third step: skipped like torch skips a
    parameter whose .grad is None (its moments and step count untouched)."""
    cfg = make_config("cpu", "nvme", nvme=scratch, lr=3e-3)
    worst, _, engine, ref = train_pair(Quirky, cfg, quirky=True)
    print("max |zinf - torch| frozen/shared/optional (Quirky): %.3g" % worst)
    assert worst < TOL
    model = engine.module
    assert engine.param_updates(model.embed.weight) == 0
    assert engine.param_updates(model.aux.weight) == 7  # steps 0, 3, ..., 18
    assert engine.param_updates(model.shared.weight) == 20
    assert torch.equal(engine.gather(model.embed.weight), ref.embed.weight.detach())


def test_parameters_hold_no_memory_between_uses_and_read_their_values():
    torch.manual_seed(0)
    model = Llama()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = zinf.initialize(model, make_config())
    for n, p in model.named_parameters():
        assert p.shape == want[n].shape, "shape queries work"
        assert p.stride() == (0,) * p.dim()  # the placeholder: no memory of its own
        assert torch.isnan(zinf._access.base_data(p)[(0,) * p.dim()])
        assert torch.equal(p.detach(), want[n]), "a read fetches the values"
    ids, tgt = batch(0)
    loss = engine(ids, tgt)
    engine.backward(loss)
    engine.step()
    assert all(p.grad is None for p in model.parameters())


def test_a_kept_view_of_a_parameter_stops_the_step_instead_of_reading_stale_memory():
    torch.manual_seed(0)
    model = Gpt2()
    engine = zinf.initialize(model, make_config())
    kept = []
    handle = model.h[0].c_fc.register_forward_hook(lambda m, i, o: kept.append(m.weight[0]))
    ids, tgt = batch(0)
    engine.backward(engine(ids, tgt))
    with pytest.raises(zinf.ZinfError, match="h.0.c_fc.weight"):
        engine.step()
    kept.clear()
    handle.remove()
    stats = engine.step()  # the view is gone: the step runs
    assert stats["optimizer_ran"]


def test_errors_are_zinf_errors_with_the_engine_message():
    with pytest.raises(zinf.ZinfError, match="offload_optimizer.device"):
        zinf.initialize(Llama(), {"zero_optimization": {"offload_optimizer": {"device": "disk"}}})
    with pytest.raises(zinf.ZinfError, match="nvme_path"):
        zinf.initialize(Llama(), {"zero_optimization": {"offload_param": {"device": "nvme"}}})
    with pytest.raises(zinf.ZinfError, match="expected 0, 1, 2 or 3") as e:
        zinf.initialize(Llama(), {"zero_optimization": {"stage": 4}})
    assert e.value.code == "InvalidArgument"


def test_converting_the_model_after_initialize_is_refused_before_it_trains_wrong():
    torch.manual_seed(0)
    model = Llama()
    engine = zinf.initialize(model, make_config())
    # Refused at the conversion itself (it would detach the parameter from zinf's gradient
    # hook), naming the parameter and both dtypes; the model still trains afterwards.
    with pytest.raises(zinf.ZinfError, match="'norm.weight'.data = a torch.float64") as e:
        model.norm.to(torch.float64)
    assert e.value.code == "InvalidArgument"
    assert model.norm.weight.dtype == torch.float32
    ids, tgt = batch(0)
    engine.backward(engine(ids, tgt))
    assert engine.step()["optimizer_ran"]


def test_an_evaluation_between_backward_and_step_is_refused_with_the_reason():
    torch.manual_seed(0)
    engine = zinf.initialize(Llama(), make_config())
    ids, tgt = batch(0)
    engine.backward(engine(ids, tgt))
    with torch.no_grad():
        with pytest.raises(zinf.ZinfError, match="evaluate between optimizer steps"):
            engine(ids)
    engine.step()
    with torch.no_grad():
        engine(ids)  # between steps: fine
