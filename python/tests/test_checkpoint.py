"""Checkpoints from Python: save, kill -9 at several points, resume: bit-identical to a run
that was never interrupted (parameters, optimizer states through the parameters they produce,
step counters, the model's persistent buffers). The same for zinf.durable without
checkpoints."""
import os
import subprocess
import sys

import pytest
import torch

import zinf
from conftest import make_config
from models import Llama, batch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_worker.py")
STEPS = 5


def worker(mode, work, out, env=None):
    full_env = dict(os.environ)
    full_env.pop("ZINF_CRASH_AT", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, WORKER, mode, work, str(STEPS), out], env=full_env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)


def assert_same(a, b, skip=()):
    assert list(a) == list(b)
    for k in a:
        if k in skip:
            continue
        assert torch.equal(a[k], b[k]), "%s differs after the resume" % k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain", numbered=True)
    out = str(root / "state.pt")
    r = worker("fresh", str(root), out)
    assert r.returncode == 0, r.stdout
    d = worker("durable-fresh", str(root / "durable"), str(root / "durable.pt"))
    assert d.returncode == 0, d.stdout
    return torch.load(out), torch.load(str(root / "durable.pt"))


KILLS = [
    ("between steps, mid-forward", {"ZINF_TEST_KILL_AT": "3"}),
    ("inside a checkpoint's files", {"ZINF_CRASH_AT": "checkpoint.files:2"}),
    ("after the folder rename, before latest", {"ZINF_CRASH_AT": "checkpoint.renamed:3"}),
    ("inside a swap write", {"ZINF_CRASH_AT": "swap.write:60"}),
    ("between optimizer sub-groups", {"ZINF_CRASH_AT": "optimizer.group:7"}),
]


@pytest.mark.parametrize("where,env", KILLS, ids=[k[0] for k in KILLS])
def test_kill_and_resume_from_the_checkpoint_is_bit_identical(where, env, scratch, uninterrupted):
    out = scratch + "/state.pt"
    killed = worker("fresh", scratch, out, env)
    assert killed.returncode == -9, "expected a SIGKILL %s: %s" % (where, killed.stdout)
    assert not os.path.exists(out)
    resumed = worker("resume", scratch, out)
    assert resumed.returncode == 0, resumed.stdout
    assert_same(torch.load(out), uninterrupted[0])


DURABLE_KILLS = [
    ("mid-forward", {"ZINF_TEST_KILL_AT": "2"}),
    ("inside a swap write", {"ZINF_CRASH_AT": "swap.write:50"}),
    ("between optimizer sub-groups", {"ZINF_CRASH_AT": "optimizer.group:5"}),
]


@pytest.mark.parametrize("where,env", DURABLE_KILLS, ids=[k[0] for k in DURABLE_KILLS])
def test_kill_and_resume_from_the_durable_store_is_bit_identical(where, env, scratch,
                                                                 uninterrupted):
    """zinf.durable: no checkpoint at all; the store commits every step. The persistent
    buffer is not in the store (documented), so it is left out of the comparison."""
    out = scratch + "/state.pt"
    killed = worker("durable-fresh", scratch, out, env)
    assert killed.returncode == -9, "expected a SIGKILL %s: %s" % (where, killed.stdout)
    resumed = worker("durable-resume", scratch, out)
    assert resumed.returncode == 0, resumed.stdout
    assert_same(torch.load(out), uninterrupted[1], skip=("seen",))


def test_in_process_save_and_load_continue_identically(scratch):
    cfg = make_config("cpu", "nvme", nvme=scratch)

    def train(engine, steps):
        for step in steps:
            ids, tgt = batch(step)
            engine.backward(engine(ids, tgt))
            engine.step()

    torch.manual_seed(3)
    model = Llama()
    engine = zinf.initialize(model, cfg)
    train(engine, range(3))
    engine.save_checkpoint(scratch + "/ckpt", client_state={"step": 3, "note": "x"})
    train(engine, range(3, 6))
    a = engine.full_state_dict()
    engine.close()

    torch.manual_seed(99)  # other initial values: everything must come from the checkpoint
    os.mkdir(scratch + "/second")
    engine = zinf.initialize(Llama(), make_config("cpu", "nvme", nvme=scratch + "/second"))
    state = engine.load_checkpoint(scratch + "/ckpt")
    assert state == {"step": 3, "note": "x"}
    assert engine.global_step == 3
    train(engine, range(3, 6))
    assert_same(engine.full_state_dict(), a)


def test_a_checkpoint_of_another_model_is_refused_and_changes_nothing(scratch):
    torch.manual_seed(3)
    engine = zinf.initialize(Llama(), make_config())
    engine.save_checkpoint(scratch + "/ckpt")
    other = zinf.initialize(Llama(dim=48, hidden=96), make_config())
    before = other.full_state_dict()
    # The folder belongs to the engine that saves there while it lives.
    with pytest.raises(zinf.ZinfError, match="is in use by pid"):
        other.load_checkpoint(scratch + "/ckpt")
    engine.close()
    with pytest.raises(zinf.ZinfError, match="does not match this model"):
        other.load_checkpoint(scratch + "/ckpt")
    assert_same(other.full_state_dict(), before)
    with pytest.raises(zinf.ZinfError):
        other.save_checkpoint(scratch + "/ckpt2", client_state={"not json": object()})


def test_close_with_restore_hands_the_values_back_to_torch():
    torch.manual_seed(3)
    model = Llama()
    engine = zinf.initialize(model, make_config())
    ids, tgt = batch(0)
    engine.backward(engine(ids, tgt))
    engine.step()
    want = engine.full_state_dict()
    engine.close(restore=True)
    got = model.state_dict()
    assert_same(got, want)
    loss = model(ids, tgt)  # plain torch again
    loss.backward()
    assert model.lm_head.weight.grad is not None
