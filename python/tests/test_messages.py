"""Threads, buffers and the mistakes a trainer makes, each with what zinf does about it: a
second thread driving an engine gets one clear error and changes nothing; a backward without
engine.step() says to call it; inf/NaN from loaded values is not blamed on the learning rate;
the pinned budget defaults to what the model needs when the machine has it (said in an info
line) and refuses only when it does not;
save_safetensors writes the persistent buffers (BatchNorm's statistics) and load_safetensors
reads them back, so an exported model evaluates the same elsewhere.
"""
import json
import threading

import pytest
import torch
import torch.nn as nn

import zinf
from conftest import make_config
from models import Llama, batch
from st_writer import read_file


def test_a_second_thread_driving_an_engine_is_refused_and_changes_nothing():
    torch.manual_seed(1)
    model = Llama()
    engine = zinf.initialize(model, make_config())
    ids, tgt = batch(0)
    engine.backward(engine(ids, tgt))
    engine.step()
    before = engine.full_state_dict()
    errors = []

    def other_thread():
        for call in (lambda: engine(ids, tgt), lambda: engine.step(),
                     lambda: engine.backward(model(ids, tgt)), lambda: model.norm.weight.sum(),
                     lambda: engine.save_checkpoint("/nonexistent/x")):
            try:
                call()
            except zinf.ZinfError as e:
                errors.append(e)

    t = threading.Thread(target=other_thread, name="intruder")
    t.start()
    t.join()
    assert len(errors) == 5
    for e in errors:
        assert e.code == "FailedPrecondition"
        assert "from thread 'intruder'" in str(e) and "driven by thread 'MainThread'" in str(e)
    assert engine.global_step == 1
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    engine.backward(engine(ids, tgt))  # the owner goes on
    assert engine.step()["optimizer_ran"]


def test_a_backward_without_step_says_to_call_step():
    torch.manual_seed(1)
    engine = zinf.initialize(Llama(), make_config())
    ids, tgt = batch(0)
    engine.backward(engine(ids, tgt))
    with pytest.raises(zinf.ZinfError, match="call engine.step\\(\\) after every backward") as e:
        engine.backward(engine(ids, tgt))
    assert "ReduceGradient" not in str(e.value)
    assert e.value.code == "FailedPrecondition"
    assert engine.step()["optimizer_ran"], "the first backward's gradients still step"


def test_nan_from_loaded_values_is_not_blamed_on_the_learning_rate(scratch):
    torch.manual_seed(1)
    model = Llama()
    engine = zinf.initialize(model, make_config())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["norm.weight"][3] = float("nan")
    model.load_state_dict(state)
    ids, tgt = batch(0)
    engine.backward(engine(ids, tgt))
    with pytest.raises(zinf.ZinfError) as e:
        engine.step()
    assert "not the cause" in str(e.value) and "lower the learning rate" not in str(e.value)
    assert "lower the learning rate" in str(e.value.__cause__), "the engine's own error kept"


def test_the_pinned_budget_defaults_to_what_the_model_needs(scratch, capfd):
    """A 23M-parameter model with parameters and states on NVMe needs 1.1 GiB of pinned
    memory (one sub-group's states x 4 buffers); the engine's 1 GiB default refused it."""
    torch.manual_seed(2)
    model = Llama(vocab=4096, dim=512, layers=6, n_heads=8, n_kv_heads=4, hidden=1536,
                  max_seq=64)
    cfg = make_config("nvme", "nvme", nvme=scratch)
    del cfg["zero_optimization"]["sub_group_size"]
    del cfg["zinf"]["pinned_budget_bytes"]
    shapes = [(n, list(p.shape), True) for n, p in model.named_parameters()]
    engine = zinf.initialize(model, cfg)
    ids = torch.randint(0, 4096, (2, 16))
    engine.backward(engine(ids, ids))
    assert engine.step()["optimizer_ran"]
    assert zinf._zinf.pinned_bytes_needed(json.dumps(cfg), shapes, True) > 1 << 30
    err = capfd.readouterr().err
    assert "zinf.pinned_budget_bytes not set: pinned host budget 1.2 GiB" in err, err


def test_a_model_the_machine_cannot_pin_for_is_refused_before_anything_is_allocated(scratch):
    # A 10-billion-element layer on the meta device: sizing needs only its shape, and the
    # refusal comes before registration would ask for its values.
    model = nn.Linear(100_000, 100_000, bias=False, device="meta")
    cfg = make_config("nvme", "nvme", nvme=scratch)
    del cfg["zero_optimization"]["sub_group_size"]
    del cfg["zinf"]["pinned_budget_bytes"]
    with pytest.raises(zinf.ZinfError, match="needs .* of pinned host memory .* available") as e:
        zinf.initialize(model, cfg)
    assert e.value.code == "ResourceExhausted"
    assert "sub_group_size" in str(e.value)


class SmallResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_buffers_round_trip_through_safetensors(scratch):
    torch.manual_seed(6)
    model = SmallResNet()
    engine = zinf.initialize(model, make_config(lr=1e-2))
    for step in range(3):
        x = torch.randn(4, 3, 8, 8)
        engine.backward(engine(x).square().mean())
        engine.step()
    zinf.save_safetensors(engine, scratch + "/with")
    files = read_file(scratch + "/with/model.safetensors")
    assert torch.equal(files["bn.running_mean"], model.bn.running_mean)
    assert torch.equal(files["bn.running_var"], model.bn.running_var)
    assert files["bn.num_batches_tracked"].dtype == torch.int64
    assert files["bn.num_batches_tracked"].item() == 3
    # Loaded elsewhere (plain torch) the model evaluates as the trained one does.
    plain = SmallResNet()
    plain.load_state_dict(files)
    model.eval()
    plain.eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(plain(x), engine(x))
    # And into another engine.
    other_model = SmallResNet()
    other = zinf.initialize(other_model, make_config())
    report = zinf.load_safetensors(other, scratch + "/with")
    assert report["unexpected"] == []
    assert torch.equal(other_model.bn.running_var, model.bn.running_var)
    assert other_model.bn.num_batches_tracked.item() == 3
    other_model.eval()
    with torch.no_grad():
        assert torch.equal(other(x), engine(x))
    # buffers=False leaves them out.
    zinf.save_safetensors(engine, scratch + "/without", buffers=False)
    assert set(read_file(scratch + "/without/model.safetensors")) == \
        {n for n, _ in model.named_parameters()}


def test_a_config_that_is_a_fifo_or_a_device_is_refused_at_once(scratch):
    """A config path naming a FIFO would block the reader forever, /dev/zero would never end:
    both are refused before any read, naming the path."""
    import os
    import time
    fifo = os.path.join(scratch, "ds_config.json")
    os.mkfifo(fifo)
    for path, what in ((fifo, "FIFO"), ("/dev/zero", "not a regular file"), (scratch, "folder")):
        t0 = time.time()
        with pytest.raises(zinf.ZinfError, match=what):
            zinf.initialize(Llama(), path)
        assert time.time() - t0 < 10, path
