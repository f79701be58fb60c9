"""Every way of reaching a parameter after zinf.initialize reads its real values, and every
write reaches the engine or is refused with a ZinfError naming the parameter: iteration over
parameters() for a penalty (in and outside the forward), state_dict() inside a forward, an
LSTM's _flat_weights, attribute reads outside any forward, a direct call of the model; and
p.zero_(), p.fill_(), p.data = t, p[i] = v, nn.init.*, model.load_state_dict.

Parity tolerance: 1e-5 as test_parity.py (zinf's AdamW and torch's differ by an ulp of each
update; the model side is the same torch code on the same values). The reads and writes
themselves are exact (torch.equal).
"""
import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zinf
from conftest import make_config
from models import Llama, batch

TOL = 1e-5


def train_pair(model_fn, loss_fn, steps=4, cfg=None, lr=3e-3):
    """`model_fn()` trained with zinf and with torch AdamW; loss_fn(model, run, ids, tgt)
    computes a step's loss, `run` being engine(...) or the model itself. Returns the largest
    parameter difference after `steps` steps and the engine."""
    torch.manual_seed(1234)
    model = model_fn()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    engine = zinf.initialize(model, cfg or make_config(lr=lr), device="cpu")
    for step in range(steps):
        ids, tgt = batch(step)
        engine.backward(loss_fn(model, engine, ids, tgt))
        engine.step()
        loss_fn(ref, ref, ids, tgt).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    got, want = engine.full_state_dict(), ref.state_dict()
    return max((got[k] - want[k]).abs().max().item() for k in want), engine


def l2(model):
    return 1e-2 * sum(p.pow(2).sum() for p in model.parameters())


def test_a_penalty_over_parameters_outside_the_forward_matches_torch():
    worst, _ = train_pair(Llama, lambda m, run, ids, tgt: run(ids, tgt) + l2(m))
    print("L2 penalty over parameters() outside the forward: max |zinf - torch| %.3g" % worst)
    assert worst < TOL


class PenalisedLlama(Llama):
    """The penalty inside the forward, over named_parameters()."""

    def forward(self, ids, targets=None):
        loss = super().forward(ids, targets)
        return loss + 1e-2 * sum(p.norm() ** 2 for _, p in self.named_parameters())


def test_a_penalty_over_named_parameters_inside_the_forward_matches_torch():
    worst, _ = train_pair(PenalisedLlama, lambda m, run, ids, tgt: run(ids, tgt))
    print("penalty over named_parameters() in the forward: max |zinf - torch| %.3g" % worst)
    assert worst < TOL


def test_calling_the_model_directly_matches_torch():
    """model(ids) instead of engine(ids): the saved weights are references too."""
    worst, _ = train_pair(Llama, lambda m, run, ids, tgt: m(ids, tgt))
    print("direct model calls: max |zinf - torch| %.3g" % worst)
    assert worst < TOL


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.rnn = nn.LSTM(16, 24, num_layers=2, batch_first=True)
        self.head = nn.Linear(24, 64)

    def forward(self, ids, targets):
        h, _ = self.rnn(self.embed(ids))
        return F.cross_entropy(self.head(h).reshape(-1, 64), targets.reshape(-1))


def test_an_lstm_trains_like_torch_and_its_flat_weights_read_real_values():
    worst, engine = train_pair(Recurrent, lambda m, run, ids, tgt: run(ids, tgt))
    print("LSTM: max |zinf - torch| %.3g" % worst)
    assert worst < TOL
    rnn = engine.module.rnn
    for name, w in zip(rnn._flat_weights_names, rnn._flat_weights):
        assert torch.equal(w.detach(), engine.gather(getattr(rnn, name))), name


class StateInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.seen = None

    def forward(self, x):
        self.seen = {k: v.clone() for k, v in self.state_dict().items()}
        return self.b(torch.tanh(self.a(x))).sum()


def test_state_dict_inside_a_forward_reads_the_current_values():
    torch.manual_seed(3)
    model = StateInForward()
    engine = zinf.initialize(model, make_config(lr=1e-2))
    for step in range(3):
        want = engine.full_state_dict()
        engine.backward(engine(torch.randn(4, 8)))
        engine.step()
        assert list(model.seen) == list(want)
        for k in want:
            assert torch.equal(model.seen[k], want[k]), (step, k)


def test_reads_outside_any_forward_fetch_the_values_and_release_them():
    torch.manual_seed(5)
    model = Llama()
    want = copy.deepcopy(model.state_dict())
    engine = zinf.initialize(model, make_config())
    w = model.layers[0].mlp.up_proj.weight  # an attribute read, outside any forward
    assert torch.equal(w.sum(), want["layers.0.mlp.up_proj.weight"].sum())
    v = torch.randn(w.shape[1])
    assert torch.equal(w @ v, want["layers.0.mlp.up_proj.weight"] @ v)
    assert torch.equal(w[3], want["layers.0.mlp.up_proj.weight"][3])
    sd = model.state_dict()
    assert all(torch.equal(sd[k], want[k]) for k in want)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)  # an ordinary checkpoint anyone can load
    buf.seek(0)
    loaded = torch.load(buf)
    assert all(type(v) is torch.Tensor and torch.equal(v, want[k]) for k, v in loaded.items())
    head = model.lm_head.weight
    assert repr(head) == repr(nn.Parameter(want["lm_head.weight"])), "repr shows the values"
    assert engine._core.views() == {}, "nothing stays acquired after the reads"
    ids, tgt = batch(0)
    engine.backward(engine(ids, tgt))
    assert engine.step()["optimizer_ran"]


def test_writes_between_steps_reach_the_engine():
    torch.manual_seed(5)
    model = Llama()
    engine = zinf.initialize(model, make_config())
    w = model.lm_head.weight
    with torch.no_grad():
        w.zero_()
    assert torch.equal(engine.gather(w), torch.zeros(w.shape))
    with torch.no_grad():
        w.fill_(0.5)
        w[0] = 2.0
        w += 1.0
    expect = torch.full(w.shape, 1.5)
    expect[0] = 3.0
    assert torch.equal(engine.gather(w), expect)
    model.norm.weight.data = torch.full((32,), 0.25)
    assert torch.equal(engine.gather(model.norm.weight), torch.full((32,), 0.25))
    model.norm.weight.detach().mul_(2)  # through a view of the whole parameter, as in torch
    assert torch.equal(engine.gather(model.norm.weight), torch.full((32,), 0.5))
    model.norm.weight.data.add_(1)  # and through .data
    assert torch.equal(engine.gather(model.norm.weight), torch.full((32,), 1.5))
    # nn.init draws the same numbers torch would for the parameter.
    torch.manual_seed(9)
    nn.init.normal_(w, std=0.02)
    torch.manual_seed(9)
    assert torch.equal(engine.gather(w), torch.empty(w.shape).normal_(std=0.02))
    torch.manual_seed(9)
    nn.init.kaiming_uniform_(w, a=5 ** 0.5)
    torch.manual_seed(9)
    assert torch.equal(engine.gather(w), nn.init.kaiming_uniform_(torch.empty(w.shape),
                                                                  a=5 ** 0.5))
    nn.init.zeros_(model.norm.weight)
    assert torch.equal(engine.gather(model.norm.weight), torch.zeros(32))
    # The next step trains from the written values.
    ids, tgt = batch(0)
    engine.backward(engine(ids, tgt))
    assert engine.step()["optimizer_ran"]


def test_load_state_dict_after_initialize_loads_through_the_engine_like_torch():
    torch.manual_seed(7)
    model = Llama()
    ref = copy.deepcopy(model)
    engine = zinf.initialize(model, make_config(lr=3e-3))
    torch.manual_seed(8)
    other = Llama().state_dict()
    assert str(model.load_state_dict(other)) == str(ref.load_state_dict(other))
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], other[k]) for k in other)
    # Training from the loaded values matches torch's.
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    for step in range(3):
        ids, tgt = batch(step)
        engine.backward(engine(ids, tgt))
        engine.step()
        ref(ids, tgt).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    got, want = engine.full_state_dict(), ref.state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) < TOL


def test_load_state_dict_keeps_torchs_strictness_and_loads_all_or_nothing():
    torch.manual_seed(7)
    model = Llama()
    ref = copy.deepcopy(model)
    engine = zinf.initialize(model, make_config())
    before = engine.full_state_dict()
    partial = {k: v + 1 for k, v in Llama().state_dict().items() if k != "norm.weight"}
    partial["extra.weight"] = torch.zeros(2)
    with pytest.raises(RuntimeError) as torch_err:
        ref.load_state_dict(partial)
    with pytest.raises(zinf.ZinfError) as err:
        model.load_state_dict(partial)
    assert str(torch_err.value) in str(err.value), "torch's own message"
    assert "no parameter was changed" in str(err.value)
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    # strict=False: the same report as torch's, the matching keys loaded.
    report = model.load_state_dict(partial, strict=False)
    assert report == ref.load_state_dict(partial, strict=False)
    after = engine.full_state_dict()
    assert torch.equal(after["norm.weight"], before["norm.weight"])
    assert torch.equal(after["lm_head.weight"], partial["lm_head.weight"])
    wrong = dict(partial)
    wrong["norm.weight"] = torch.zeros(33)
    with pytest.raises(zinf.ZinfError, match="size mismatch for norm.weight"):
        model.load_state_dict(wrong, strict=False)


def test_writes_that_cannot_reach_the_parameter_are_refused_with_its_name():
    torch.manual_seed(5)
    model = Llama()
    engine = zinf.initialize(model, make_config())
    w = model.lm_head.weight
    before = engine.gather(w)
    part = w.detach()[0]
    with pytest.raises(zinf.ZinfError, match="a part of parameter 'lm_head.weight'") as e:
        part.fill_(1.0)  # a view of a part: torch would write the parameter, zinf cannot
    assert e.value.code == "FailedPrecondition"
    with pytest.raises(zinf.ZinfError, match="'lm_head.weight'.data = a torch.float16"):
        w.data = torch.zeros(w.shape, dtype=torch.float16)
    with pytest.raises(zinf.ZinfError, match="'lm_head.weight'.data = a torch.float32 \\(3,\\)"):
        w.data = torch.zeros(3)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        w.zero_()  # as torch: an in-place change of a leaf needs torch.no_grad()
    ids, tgt = batch(0)
    loss = engine(ids, tgt)
    with torch.no_grad():
        with pytest.raises(zinf.ZinfError, match="'lm_head.weight': zero_ during a micro-step"):
            w.zero_()
    engine.backward(loss)
    with pytest.raises(zinf.ZinfError, match="lm_head.weight"):
        model.load_state_dict(Llama().state_dict())
    engine.step()
    assert not torch.equal(engine.gather(w), torch.zeros(w.shape)), "the refused writes did nothing"
    assert not torch.equal(engine.gather(w), before), "the step ran"


def test_a_closed_engines_parameters_refuse_use_unless_restored():
    torch.manual_seed(5)
    model = Llama()
    engine = zinf.initialize(model, make_config())
    engine.close()
    with pytest.raises(zinf.ZinfError, match="closed"):
        model.norm.weight.sum()
    with pytest.raises(zinf.ZinfError, match="'embed_tokens.weight' belonged to a zinf engine"):
        zinf.initialize(model, make_config())
    model = Llama()
    want = copy.deepcopy(model.state_dict())
    engine = zinf.initialize(model, make_config())
    engine.close(restore=True)
    assert type(model.norm.weight) is nn.Parameter
    assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)


def test_a_dropped_engine_is_named_after_a_direct_call_that_raised():
    """A direct model(x) call that raises leaves its forward frame and saved-tensor hooks
    behind; once the engine is dropped, a parameter read says the engine is gone (ZinfError),
    it does not acquire through the dead engine (an AttributeError, which hasattr() would take
    for a missing parameter), and autograd elsewhere is not broken by the hooks."""
    import gc

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            self.a(x)
            raise RuntimeError("boom")

    model = Boom()
    engine = zinf.initialize(model, make_config(), device="cpu")
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(2, 4))
    del engine
    gc.collect()
    assert hasattr(model.b, "weight")
    with pytest.raises(zinf.ZinfError, match="no longer exists"):
        model.b.weight + 1
    # The raised call left the engine's saved-tensor hooks on torch's stack: with the engine
    # gone they hand autograd what it saved, so backward elsewhere in the process still works.
    x = torch.randn(3, requires_grad=True)
    (x * x).sum().backward()
    assert torch.equal(x.grad, 2 * x.detach())
