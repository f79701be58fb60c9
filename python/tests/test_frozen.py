"""Frozen parameters (requires_grad=False at zinf.initialize, issue 30): the set of trained
parameters is fixed at zinf.initialize, so unfreezing one afterwards is refused wherever it is
first seen (the setter, the next forward with gradients, a gradient reaching .grad), each time
with one message that names the parameter, says why and how to change the trained set (and is
not the old "hold a .grad that never reached zinf", which blamed a detached hook); freezing a
trained parameter after initialize just leaves it without gradients (skipped, unchanged);
save_safetensors(trainable_only=True) exports the trained parameters alone, buffers only when
asked.
"""
import os

import pytest
import torch
import torch.nn as nn

import zinf
from conftest import make_config
from models import Llama, batch
from st_writer import read_file


def assert_refusal_says_how(excinfo, names):
    e = excinfo.value
    msg = str(e)
    assert "never reached zinf" not in msg, "the old message, which blamed a detached hook"
    assert e.code == "FailedPrecondition"
    for n in names:
        assert "'%s'" % n in msg
    assert "frozen (requires_grad=False) when zinf.initialize registered them" in msg
    assert "fixes the set of trained parameters at zinf.initialize" in msg
    assert "no fp32 master, no optimizer states" in msg
    assert "Set requires_grad before zinf.initialize" in msg
    assert "zinf.save_safetensors" in msg and "zinf.load_safetensors" in msg


def frozen_llama(*frozen):
    torch.manual_seed(3)
    model = Llama()
    named = dict(model.named_parameters())
    for n in frozen:
        named[n].requires_grad_(False)
    return model, named


def train_step(engine, step=0):
    ids, tgt = batch(step)
    engine.backward(engine(ids, tgt))
    return engine.step()


def test_unfreezing_after_initialize_is_refused_at_the_setter_and_training_goes_on():
    model, named = frozen_llama("embed_tokens.weight")
    p = named["embed_tokens.weight"]
    before = p.detach().clone()
    engine = zinf.initialize(model, make_config())
    for unfreeze in (lambda: p.requires_grad_(True), lambda: p.requires_grad_(),
                     lambda: setattr(p, "requires_grad", True),
                     lambda: model.requires_grad_(True)):
        with pytest.raises(zinf.ZinfError) as e:
            unfreeze()
        assert_refusal_says_how(e, ["embed_tokens.weight"])
        assert "requires_grad=True after zinf.initialize is refused" in str(e.value)
        assert not p.requires_grad, "nothing changed"
    p.requires_grad_(False)  # freezing it again: fine
    for step in range(2):
        assert train_step(engine, step)["optimizer_ran"]
    assert engine.param_updates(p) == 0
    assert engine.param_updates(named["lm_head.weight"]) == 2
    assert torch.equal(engine.gather(p), before)


def test_unfreezing_past_the_setter_is_refused_by_the_next_forward():
    model, named = frozen_llama("norm.weight", "lm_head.weight")
    engine = zinf.initialize(model, make_config())
    with torch._C.DisableTorchFunction():  # past zinf's check of the setter
        named["lm_head.weight"].requires_grad = True
    ids, tgt = batch(0)
    with pytest.raises(zinf.ZinfError) as e:
        engine(ids, tgt)
    assert_refusal_says_how(e, ["lm_head.weight"])
    assert "'norm.weight'" not in str(e.value), "only the one unfrozen"
    with torch.no_grad():
        engine(ids)  # an evaluation computes no gradients: not refused
    named["lm_head.weight"].requires_grad_(False)
    assert train_step(engine)["optimizer_ran"]
    assert engine.param_updates(named["lm_head.weight"]) == 0


def test_a_gradient_reaching_a_frozen_parameter_is_refused_at_step_with_the_reason():
    model, named = frozen_llama("layers.0.mlp.up_proj.weight")
    p = named["layers.0.mlp.up_proj.weight"]
    engine = zinf.initialize(model, make_config())

    def unfreeze(module, inputs):  # inside the forward, after the engine's checks
        with torch._C.DisableTorchFunction():
            p.requires_grad = True

    handle = model.layers[0].register_forward_pre_hook(unfreeze)
    ids, tgt = batch(0)
    engine.backward(engine(ids, tgt))
    with pytest.raises(zinf.ZinfError) as e:
        engine.step()
    assert_refusal_says_how(e, ["layers.0.mlp.up_proj.weight"])
    assert "a gradient reached their .grad" in str(e.value)
    handle.remove()
    p.requires_grad_(False)
    engine.zero_grad()
    assert engine.step()["optimizer_ran"], "the other gradients of the micro-step still step"
    assert engine.param_updates(p) == 0


def test_freezing_after_initialize_leaves_a_parameter_without_gradients():
    model, named = frozen_llama()
    p = named["layers.1.self_attn.q_proj.weight"]
    engine = zinf.initialize(model, make_config())
    assert train_step(engine, 0)["optimizer_ran"]
    p.requires_grad_(False)
    kept = engine.gather(p)
    for step in (1, 2):
        assert train_step(engine, step)["optimizer_ran"]
    assert engine.param_updates(p) == 1, "skipped as torch skips a parameter whose grad is None"
    assert torch.equal(engine.gather(p), kept)
    p.requires_grad_(True)  # registered trainable: it trains again
    train_step(engine, 3)
    assert engine.param_updates(p) == 2
    assert engine.param_updates(named["norm.weight"]) == 4


def test_a_parameter_left_out_of_model_parameters_may_keep_requires_grad():
    torch.manual_seed(3)
    model = Llama()
    trained = [model.lm_head.weight, model.norm.weight]
    cfg = make_config()
    engine, _, _, _ = zinf.initialize(model=model, model_parameters=trained, config=cfg)
    model.embed_tokens.weight.requires_grad_(True)  # it requires grad: its gradient is dropped
    assert train_step(engine)["optimizer_ran"]
    assert engine.param_updates(model.embed_tokens.weight) == 0
    assert engine.param_updates(model.lm_head.weight) == 1


class Net(nn.Module):
    """A frozen layer, a BatchNorm (buffers; its affine parameters frozen), a trained head."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 4)
        for p in list(self.body.parameters()) + list(self.bn.parameters()):
            p.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.body(x))))


def test_save_safetensors_trainable_only_exports_the_trained_parameters_alone(scratch):
    torch.manual_seed(5)
    model = Net()
    engine = zinf.initialize(model, make_config(lr=1e-2))
    for step in range(3):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    want = {n: engine.gather(p) for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(want) == ["head.bias", "head.weight"]
    zinf.save_safetensors(engine, os.path.join(scratch, "only"), trainable_only=True)
    got = read_file(os.path.join(scratch, "only", "model.safetensors"))
    assert sorted(got) == sorted(want), "no frozen parameter, no buffer"
    assert all(torch.equal(got[n], want[n]) for n in want)
    zinf.save_safetensors(engine, os.path.join(scratch, "bufs"), trainable_only=True,
                          buffers=True)
    got = read_file(os.path.join(scratch, "bufs", "model.safetensors"))
    assert sorted(got) == sorted(list(want) + ["bn.num_batches_tracked", "bn.running_mean",
                                               "bn.running_var"])
    assert torch.equal(got["bn.running_mean"], model.bn.running_mean)
    zinf.save_safetensors(engine, os.path.join(scratch, "all"))  # the default: everything
    assert len(read_file(os.path.join(scratch, "all", "model.safetensors"))) == 9


def test_save_safetensors_trainable_only_without_trained_parameters_is_refused(scratch):
    model = nn.Linear(4, 4)
    model.requires_grad_(False)
    engine = zinf.initialize(model, make_config())
    with pytest.raises(zinf.ZinfError, match="trains no parameter"):
        zinf.save_safetensors(engine, os.path.join(scratch, "none"), trainable_only=True)
