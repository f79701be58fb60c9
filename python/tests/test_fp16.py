"""fp16 with dynamic loss scaling (DeepSpeed's "fp16" block): parameters stored as float16, the
loss scaled in the backward, a step whose gradients overflow skipped (no update, the scale
lowered, the learning-rate scheduler not stepped), the scale read live. torch 1.13 on the CPU
has no float16 matmul, so the test model stores its weights in float16 and computes in fp32
(as autocast would on a GPU): the float16 gradients are what zinf handles."""
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zinf
import zinf.launch
from conftest import make_config

sys.path.insert(0, zinf.launch.deepspeed_path())
import deepspeed  # noqa: E402


class F32Linear(nn.Linear):
    def forward(self, x):
        return F.linear(x.float(), self.weight.float(), self.bias.float())


class F32Embedding(nn.Embedding):
    def forward(self, ids):
        return F.embedding(ids, self.weight.float())


class TinyLm(nn.Module):
    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.embed = F32Embedding(vocab, dim)
        self.hidden = F32Linear(dim, dim)
        self.head = F32Linear(dim, vocab)

    def forward(self, ids, targets):
        x = torch.tanh(self.hidden(self.embed(ids)))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def batch(step):
    g = torch.Generator().manual_seed(1000 + step % 4)
    ids = torch.randint(0, 64, (4, 16), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def train(fp16, steps, scale_power=32, hysteresis=2, blow_up_at=-1):
    torch.manual_seed(5)
    cfg = make_config("cpu", "cpu", lr=3e-3)
    cfg["fp16"] = {"enabled": fp16, "initial_scale_power": scale_power,
                   "hysteresis": hysteresis, "loss_scale_window": 1000}
    model = TinyLm()
    engine, _, _, sched = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0))
    record = []
    for step in range(steps):
        ids, tgt = batch(step)
        loss = engine(ids, tgt)
        scale = engine.optimizer.cur_scale
        before = {k: v.clone() for k, v in engine.full_state_dict().items()} \
            if step == blow_up_at else None
        engine.backward(loss * 1e30 if step == blow_up_at else loss)
        engine.step()
        record.append((float(loss), scale, engine.optimizer.overflow, engine.was_step_applied(),
                       engine.skipped_steps))
        if before is not None:
            after = engine.full_state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step moved"
    return engine, record, sched


def test_fp16_trains_like_fp32_after_skipping_the_overflowing_steps():
    steps = 60
    fp32, r32, _ = train(False, steps)
    fp16, r16, sched = train(True, steps)
    assert fp16.fp16_enabled() and not fp32.fp16_enabled()
    assert fp16.module.head.weight.dtype == torch.float16
    skipped = fp16.skipped_steps
    # From 2^32 the first steps overflow (hysteresis 2: from the second overflow on, each
    # halves the scale), then the scale holds and every step applies.
    assert 0 < skipped < 25, r16
    overflows = [o for _, _, o, _, _ in r16]
    assert overflows == [True] * skipped + [False] * (steps - skipped)
    assert [a for _, _, _, a, _ in r16] == [False] * skipped + [True] * (steps - skipped)
    assert r16[0][1] == 2.0 ** 32 and fp16.optimizer.cur_scale <= 2 ** 20
    assert fp32.optimizer.cur_scale == 1.0
    assert fp32.skipped_steps == 0 and all(a for _, _, _, a, _ in r32)
    # The scheduler stepped only for the steps that applied (DeepSpeed's).
    assert sched.last_epoch == steps - skipped
    # It learns, and after as many updates as fp32's run it is within 2 % of fp32's loss (fp16
    # weights round each update). Means over 4 steps: the batches cycle every 4.
    def mean(r, end):
        return sum(x[0] for x in r[end - 4:end]) / 4

    assert mean(r16, steps) < 0.9 * mean(r16, 4), r16
    l16, l32 = mean(r16, steps), mean(r32, steps - skipped)
    assert abs(l16 - l32) <= 0.02 * l32, (l16, l32)


def test_an_overflow_mid_run_skips_that_step_only_and_halves_the_scale():
    engine, record, sched = train(True, 12, scale_power=8, hysteresis=1, blow_up_at=6)
    overflows = [o for _, _, o, _, _ in record]
    assert overflows == [False] * 6 + [True] + [False] * 5, record
    assert record[6][1] == 256.0 and record[7][1] == 128.0, record
    assert engine.skipped_steps == 1 and engine.global_steps == 12
    assert sched.last_epoch == 11
    assert engine.optimizer.loss_scale == engine.optimizer.cur_scale == 128.0


def test_the_scaler_comes_back_with_a_checkpoint(scratch):
    engine, _, _ = train(True, 8, scale_power=8, hysteresis=1, blow_up_at=3)
    assert engine.optimizer.cur_scale == 128.0 and engine.skipped_steps == 1
    engine.save_checkpoint(scratch)
    engine.close()  # (its checkpoint folder lock goes with it)
    again, _, _ = train(True, 0, scale_power=8)
    assert again.optimizer.cur_scale == 256.0 and again.skipped_steps == 0
    again.load_checkpoint(scratch)
    assert again.optimizer.cur_scale == 128.0 and again.skipped_steps == 1


def first_step_norm(fp16, gas):
    torch.manual_seed(5)
    # A static scale, and clipping that never clips, so that the norm (of the unscaled
    # gradients) is reported.
    cfg = make_config("cpu", "cpu", lr=3e-3, gas=gas, clip=1e9)
    cfg["fp16"] = {"enabled": fp16, "loss_scale": 1024}
    model = TinyLm()
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                  config=cfg)[0]
    for micro in range(gas):
        engine.backward(engine(*batch(micro)))
        engine.step()
        assert engine.optimizer.overflow is False
        assert engine.was_step_applied() is (micro == gas - 1)
    return engine.get_global_grad_norm(), engine.optimizer.cur_scale


def test_the_gradients_are_scaled_once_and_unscaled_once():
    # The engine's gradient norm is of the unscaled gradients: a scale missing, applied twice
    # or left in (1024x) would be far off; fp16 weights and gradients round at ~1e-3.
    for gas in (1, 2):
        n32, _ = first_step_norm(False, gas)
        n16, scale = first_step_norm(True, gas)
        assert scale == 1024.0
        assert n32 > 0 and abs(n16 - n32) <= 0.01 * n32, (gas, n16, n32)


def test_a_plain_loss_backward_is_refused_under_fp16():
    model = TinyLm()
    cfg = make_config("cpu", "cpu")
    cfg["fp16"] = {"enabled": True}
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                  config=cfg)[0]
    with pytest.raises(zinf.ZinfError, match="outside engine.backward"):
        engine(*batch(0)).backward()
