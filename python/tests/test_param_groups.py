"""Parameter groups (the engine's, Engine::SetParamGroup): Hugging Face's two groups (weight decay
on weights, none on biases and norms) and DeepSpeed-Chat's third (the LoRA-like weights at their
own learning rate), given as model_parameters dicts or as a torch optimizer's groups, train as
torch's AdamW with the same groups does (every parameter within 1e-5 after 12 steps, the
tolerance of test_parity.py, for the same reason: two kernels evaluating one formula in a
different order); a torch scheduler scaling each group's rate (LambdaLR) moves each group; a
checkpoint carries every group's values; what zinf cannot do is refused, naming it.
"""
import copy
import os

import pytest
import torch

import zinf
from conftest import make_config
from models import Llama, batch

TOL = 1e-5


def grouping(model):
    """[weights with decay], [biases and norms: no decay], [the attention's q_proj: its own
    lr and betas] as (name, params) lists."""
    decay, no_decay, own = [], [], []
    for name, p in model.named_parameters():
        if "q_proj" in name:
            own.append(p)
        elif p.dim() < 2 or "norm" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return decay, no_decay, own


def groups_of(model):
    decay, no_decay, own = grouping(model)
    return [{"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": own, "lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.05}]


def run(engine, ref, opt, steps, sched=None, ref_sched=None):
    for step in range(steps):
        ids, tgt = batch(step)
        engine.backward(engine(ids, tgt))
        engine.step()
        ref(ids, tgt).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ref_sched is not None:
            ref_sched.step()


def worst_difference(engine, ref):
    got = engine.full_state_dict()
    want = ref.state_dict()
    return max((got[k] - want[k]).abs().max().item() for k in want)


@pytest.mark.parametrize("param,states", [("cpu", "cpu"), ("nvme", "nvme")])
def test_model_parameter_groups_match_torch_adamw(param, states, scratch):
    torch.manual_seed(11)
    model = Llama()
    ref = copy.deepcopy(model)
    cfg = make_config(param, states, nvme=scratch, lr=3e-3, weight_decay=0.01)
    engine, optimizer, _, _ = zinf.initialize(model=model, model_parameters=groups_of(model),
                                              config=cfg)
    # Missing keys take the config's values, as DeepSpeed's optimizer built from the config.
    opt = torch.optim.AdamW(groups_of(ref), lr=3e-3, betas=(0.9, 0.999), eps=1e-8)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0, 0.05]
    assert [g["lr"] for g in optimizer.param_groups] == [3e-3, 3e-3, 1e-2]
    run(engine, ref, opt, 12)
    worst = worst_difference(engine, ref)
    print("max |zinf - torch| with three groups (params %s, states %s): %.3g"
          % (param, states, worst))
    assert worst < TOL
    mine = engine.full_state_dict()
    engine.close()
    # Not one group's values for all: the same run with the config's values differs by far more.
    torch.manual_seed(11)
    plain = Llama()
    e2 = zinf.initialize(plain, make_config(param, states, nvme=scratch, lr=3e-3))
    for step in range(12):
        ids, tgt = batch(step)
        e2.backward(e2(ids, tgt))
        e2.step()
    other = e2.full_state_dict()
    assert max((other[k] - mine[k]).abs().max().item() for k in mine) > 100 * TOL


def test_a_client_optimizers_groups_and_a_per_group_scheduler_match_torch(scratch):
    torch.manual_seed(12)
    model = Llama()
    ref = copy.deepcopy(model)
    client = torch.optim.AdamW(groups_of(model), lr=3e-3, eps=1e-7)
    factors = [lambda s: 1.0 / (1 + s), lambda s: 0.5 ** s, lambda s: 1.0]
    cfg = make_config()
    del cfg["optimizer"]  # the client's optimizer is the one
    engine, optimizer, _, sched = zinf.initialize(
        model=model, optimizer=client, config=cfg,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, factors))
    opt = torch.optim.AdamW(groups_of(ref), lr=3e-3, eps=1e-7)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(opt, factors)
    run(engine, ref, opt, 8, ref_sched=ref_sched)
    assert optimizer.param_groups is client.param_groups
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in opt.param_groups]
    worst = worst_difference(engine, ref)
    print("max |zinf - torch| with a client optimizer's groups and LambdaLR: %.3g" % worst)
    assert worst < TOL


def test_checkpoints_carry_every_groups_values(scratch):
    torch.manual_seed(13)
    model = Llama()
    engine, optimizer, _, _ = zinf.initialize(model=model, model_parameters=groups_of(model),
                                              config=make_config(lr=3e-3))
    run_one = lambda e: (e.backward(e(*batch(0))), e.step())  # noqa: E731
    run_one(engine)
    optimizer.param_groups[2]["lr"] = 7e-3
    optimizer.param_groups[1]["betas"] = (0.85, 0.99)
    engine.save_checkpoint(os.path.join(scratch, "ck"), tag="t")
    optimizer.param_groups[2]["lr"] = 1.0
    optimizer.param_groups[1]["betas"] = (0.5, 0.5)
    engine.load_checkpoint(os.path.join(scratch, "ck"), tag="t")
    assert optimizer.param_groups[2]["lr"] == 7e-3
    assert tuple(optimizer.param_groups[1]["betas"]) == (0.85, 0.99)
    engine.close()
    # Another grouping cannot load it.
    torch.manual_seed(13)
    m2 = Llama()
    decay, no_decay, own = grouping(m2)
    e2, _, _, _ = zinf.initialize(model=m2, model_parameters=[
        {"params": decay + own}, {"params": no_decay, "weight_decay": 0.0}],
        config=make_config(lr=3e-3))
    with pytest.raises(zinf.ZinfError, match="saved with 3 parameter groups.* has 2"):
        e2.load_checkpoint(os.path.join(scratch, "ck"), tag="t")
    e2.close()
    # As many groups, other members: refused, naming a parameter in another group.
    torch.manual_seed(13)
    m3 = Llama()
    decay, no_decay, own = grouping(m3)
    e3, _, _, _ = zinf.initialize(model=m3, model_parameters=[
        {"params": no_decay}, {"params": decay}, {"params": own}], config=make_config(lr=3e-3))
    with pytest.raises(zinf.ZinfError, match=r"in group \d.*\(here in group \d\)"):
        e3.load_checkpoint(os.path.join(scratch, "ck"), tag="t")


def test_group_refusals():
    torch.manual_seed(14)
    model = Llama()
    decay, no_decay, _ = grouping(model)
    with pytest.raises(zinf.ZinfError, match="in groups 0 and 1"):
        zinf.initialize(model=model, model_parameters=[{"params": decay},
                                                       {"params": decay[:1]}],
                        config=make_config())
    with pytest.raises(zinf.ZinfError, match="group 1: amsgrad=True"):
        zinf.initialize(model=model, model_parameters=[{"params": decay},
                                                       {"params": no_decay, "amsgrad": True}],
                        config=make_config())
    with pytest.raises(zinf.ZinfError, match="parameter group 1: betas"):
        zinf.initialize(model=model, model_parameters=[{"params": decay},
                                                       {"params": no_decay,
                                                        "betas": (0.9, 1.5)}],
                        config=make_config())
    with pytest.raises(zinf.ZinfError, match="optimizer SGD"):
        zinf.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        config={k: v for k, v in make_config().items() if k != "optimizer"})
    engine, optimizer, _, _ = zinf.initialize(
        model=model, model_parameters=[{"params": decay}, {"params": no_decay}],
        config=make_config())
    with pytest.raises(zinf.ZinfError, match="add_param_group"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    optimizer.param_groups[1]["eps"] = -1.0
    with pytest.raises(zinf.ZinfError, match="parameter group 1: eps"):
        engine.backward(engine(*batch(0)))


def test_config_schedules_scale_every_group_as_deepspeeds():
    """WarmupCosineLR scales each group's own rate (DeepSpeed's org_lrs); WarmupLR gives every
    group the schedule's one rate (DeepSpeed's scalar warmup_max_lr)."""
    torch.manual_seed(15)
    model = Llama()
    decay, no_decay, _ = grouping(model)
    cfg = make_config(lr=1e-3)
    cfg["scheduler"] = {"type": "WarmupCosineLR",
                        "params": {"total_num_steps": 10, "warmup_num_steps": 2,
                                   "warmup_min_ratio": 0.5, "warmup_type": "linear"}}
    _, optimizer, _, sched = zinf.initialize(
        model=model, model_parameters=[{"params": decay}, {"params": no_decay, "lr": 4e-3}],
        config=cfg)
    sched.step()
    sched.step()  # iteration 1: ratio 0.5 + (1/2)(1 - 0.5) = 0.75 of each group's own rate
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([7.5e-4, 3e-3],
                                                                       rel=1e-12)
    torch.manual_seed(15)
    m2 = Llama()
    decay, no_decay, _ = grouping(m2)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                       "warmup_max_lr": 1e-3,
                                                       "warmup_num_steps": 4}}
    _, opt2, _, _ = zinf.initialize(
        model=m2, model_parameters=[{"params": decay}, {"params": no_decay, "lr": 4e-3}],
        config=cfg)
    assert [g["lr"] for g in opt2.param_groups] == [0.0, 0.0]


def test_adagrad_options_zinf_lacks_are_refused():
    torch.manual_seed(16)
    model = Llama()
    cfg = {k: v for k, v in make_config().items() if k != "optimizer"}
    with pytest.raises(zinf.ZinfError, match="group 0: lr_decay=0.1"):
        zinf.initialize(model=model, optimizer=torch.optim.Adagrad(model.parameters(),
                                                                   lr_decay=0.1), config=cfg)


def test_a_multistep_schedule_survives_a_checkpoint(scratch):
    """MultiStepLR's state holds a Counter of int milestones, which JSON would turn into string
    keys (the rate would then never decay after a resume): it is saved as torch.save's bytes."""
    torch.manual_seed(17)
    model = Llama()
    cfg = {k: v for k, v in make_config().items() if k != "optimizer"}
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, optimizer, _, sched = zinf.initialize(
        model=model, optimizer=client, config=cfg,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[2], gamma=0.1))
    step = lambda: (engine.backward(engine(*batch(0))), engine.step())  # noqa: E731
    step()
    engine.save_checkpoint(os.path.join(scratch, "ck"), tag="one")
    step()
    step()
    decayed = optimizer.param_groups[0]["lr"]
    assert decayed == pytest.approx(1e-3)
    engine.load_checkpoint(os.path.join(scratch, "ck"), tag="one")
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)
    step()
    step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(decayed)
