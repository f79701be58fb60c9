"""Evaluation passes between steps, bf16 parameters, and the GPU-less defaults."""
import copy
import os

import pytest
import torch

import zinf
from conftest import make_config
from models import Gpt2, Llama, batch


def run(model, cfg, steps, eval_every=0, on_step=None):
    engine = zinf.initialize(model, cfg, device="cpu")
    losses, stats = [], []
    for step in range(steps):
        ids, tgt = batch(step)
        loss = engine(ids, tgt)
        engine.backward(loss)
        stats.append(engine.step())
        losses.append(loss.item())
        if eval_every and step % eval_every == 0:
            engine.eval()
            with torch.no_grad():
                ids, tgt = batch(100 + step)
                engine(ids, tgt)
                engine(ids)  # another path through the model (no loss)
            engine.train()
        if on_step:
            on_step(engine, step)
    return engine, losses, stats


def test_eval_passes_between_steps_neither_warn_nor_stop_prefetch_nor_change_training(
        scratch, capfd):
    """With parameters evicted after every use (persistence and reuse distance 0, NVMe),
    every hit is prefetch's doing: the steps after evaluation passes must hit as often as
    the steps of a run without them, with the trace valid, no warning, and the same values."""
    os.mkdir(scratch + "/plain")
    os.mkdir(scratch + "/eval")
    torch.manual_seed(7)
    model = Gpt2()
    twin = copy.deepcopy(model)
    plain, plain_losses, plain_stats = run(twin, make_config("nvme", "nvme",
                                                             nvme=scratch + "/plain"), 6)
    capfd.readouterr()
    evald, losses, stats = run(model, make_config("nvme", "nvme", nvme=scratch + "/eval"), 6,
                               eval_every=1)
    err = capfd.readouterr().err
    assert "trace" not in err, err
    for s, p in zip(stats[1:], plain_stats[1:]):
        assert s["trace_valid"]
        assert s["prefetch_hits"] == p["prefetch_hits"] > 0
        assert s["prefetch_misses"] == p["prefetch_misses"]
    assert losses == plain_losses
    a, b = evald.full_state_dict(), plain.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_eval_pass_before_the_first_step_does_not_become_the_trace(scratch, capfd):
    cfg = make_config("cpu", "cpu")
    torch.manual_seed(7)
    model = Llama()
    engine = zinf.initialize(model, cfg)
    with torch.no_grad():
        engine(batch(9)[0])  # inference only: not recorded
    for step in range(3):
        ids, tgt = batch(step)
        engine.backward(engine(ids, tgt))
        stats = engine.step()
        assert stats["trace_valid"]
    assert "trace" not in capfd.readouterr().err


def test_a_checkpoint_can_follow_an_eval_pass(scratch):
    cfg = make_config("cpu", "nvme", nvme=scratch)
    torch.manual_seed(7)
    engine = zinf.initialize(Llama(), cfg)
    ids, tgt = batch(0)
    engine.backward(engine(ids, tgt))
    engine.step()
    with torch.no_grad():
        engine(ids)
    engine.save_checkpoint(scratch + "/ckpt", {"after": "eval"})
    assert engine.load_checkpoint(scratch + "/ckpt") == {"after": "eval"}


def test_bf16_parameters_learn_and_track_the_fp32_run(scratch):
    """bf16 parameters (zinf's parameter stores and the model's compute in bf16, fp32 masters
    and states): the loss must fall like the fp32 run's. Tolerance: bf16 keeps 8 bits of
    mantissa, so each weight and activation the forward reads is off by up to 2^-9 (0.2%)
    relative; through the model's ~10 rounded stages that could move the loss by ~1% (measured:
    0.05% at the worst step), so 5% per step bounds it with room; and after 20 steps the
    fp32 masters, updated from bf16-computed gradients (each off by ~2^-9 relative, Adam
    normalising them), stay within 0.05 of the fp32 run's (values ~0.1-1; measured 0.016)."""
    torch.manual_seed(11)
    model32 = Llama()
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    os.mkdir(scratch + "/fp32")
    os.mkdir(scratch + "/bf16")
    e32, l32, _ = run(model32, make_config("cpu", "nvme", nvme=scratch + "/fp32", lr=3e-3), 20)
    e16, l16, _ = run(model16, make_config("cpu", "nvme", nvme=scratch + "/bf16", lr=3e-3,
                                           bf16=True), 20)
    assert all(p.dtype == torch.bfloat16 for p in model16.parameters())
    assert l16[-1] < l16[0] - 0.5, "bf16 learns: %s" % l16
    worst_loss = max(abs(a - b) / b for a, b in zip(l16, l32))
    m32, m16 = e32.full_state_dict(), e16.full_state_dict()
    worst_param = max((m16[k] - m32[k]).abs().max().item() for k in m32)
    print("bf16 vs fp32: worst relative loss difference %.3g, worst parameter difference %.3g"
          % (worst_loss, worst_param))
    assert worst_loss < 0.05
    assert worst_param < 0.05
    # The gathered bf16 export is the masters rounded to nearest even.
    w = e16.gather(model16.lm_head.weight)
    assert torch.equal(e16.gather(model16.lm_head.weight, torch.bfloat16), w.to(torch.bfloat16))


def test_default_device_is_the_host_without_a_gpu():
    if zinf.cuda_available():
        pytest.skip("a GPU is visible: the default is cuda")
    engine = zinf.initialize(Llama(), None)
    assert engine.device == torch.device("cpu")
    ids, tgt = batch(0)
    engine.backward(engine(ids, tgt))
    assert engine.step()["optimizer_ran"]


def test_int8_optimizer_states_learn_like_fp32_ones(scratch):
    """zinf.optimizer_state_dtype int8 from PyTorch: the engine keeps the moments blockwise
    8-bit (about 6 bytes per parameter with the master instead of 12), the summary names it,
    and the loss falls like the fp32 run's. Tolerance: the moments carry 1/16 (first) and 1/32
    (second) relative precision, so each update's direction is off by a few percent per
    element; over 20 steps the losses stay within 5% of the fp32 run's per step (the kernels'
    own tests check the arithmetic bit for bit)."""
    torch.manual_seed(11)
    model32 = Llama()
    model8 = copy.deepcopy(model32)
    os.mkdir(scratch + "/fp32")
    os.mkdir(scratch + "/int8")
    cfg8 = make_config("cpu", "nvme", nvme=scratch + "/int8", lr=3e-3,
                       optimizer_state_dtype="int8")
    assert zinf._zinf.parse_config(__import__("json").dumps(cfg8))["optimizer_state_dtype"] == "int8"
    e32, l32, _ = run(model32, make_config("cpu", "nvme", nvme=scratch + "/fp32", lr=3e-3), 20)
    e8, l8, _ = run(model8, cfg8, 20)
    assert l8[-1] < l8[0] - 0.5, "int8 states learn: %s" % l8
    worst = max(abs(a - b) / b for a, b in zip(l8, l32))
    print("int8 vs fp32 states: worst relative loss difference %.3g" % worst)
    assert worst < 0.05
    m32, m8 = e32.full_state_dict(), e8.full_state_dict()
    assert any(not torch.equal(m32[k], m8[k]) for k in m32), "int8 states changed nothing"


def test_speculative_step_config_reads_back_as_written():
    """zinf.speculative_step: true, false or "auto" (the default), reported as the config writes
    them; another value is refused naming the key."""
    import json
    parse = zinf._zinf.parse_config
    assert parse(json.dumps({"zinf": {"speculative_step": True}}))["speculative_step"] is True
    assert parse(json.dumps({"zinf": {"speculative_step": False}}))["speculative_step"] is False
    assert parse(json.dumps({"zinf": {"speculative_step": "auto"}}))["speculative_step"] == "auto"
    assert parse("{}")["speculative_step"] == "auto"
    with pytest.raises(Exception) as err:
        parse(json.dumps({"zinf": {"speculative_step": "yes"}}))
    assert "zinf.speculative_step" in str(err.value)
