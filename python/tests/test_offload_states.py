"""engine.offload_states() / reload_states() (DeepSpeed's, for RLHF loops): between steps the
device memory zinf holds goes to host memory and comes back, and the training continues
bit-identically to one without it."""
import pathlib
import sys

import pytest
import torch

import zinf
import zinf.launch
from conftest import make_config
from models import Llama, batch

sys.path.insert(0, zinf.launch.deepspeed_path())
from deepspeed.runtime.zero.offload_config import (OffloadDeviceEnum,  # noqa: E402
                                                   OffloadStateTypeEnum)


def optimizer_step(engine, step, gas):
    for micro in range(gas):
        ids, tgt = batch(step, micro)
        engine.backward(engine(ids, tgt))
        engine.step()


def train(offload, steps=6, gas=2):
    torch.manual_seed(7)
    model = Llama()
    # Parameters and optimizer states in device memory: what offload_states moves.
    cfg = make_config("none", "none", gas=gas, lr=3e-3)
    engine = zinf.initialize(model, cfg, device="cpu")
    used = []
    for step in range(steps):
        optimizer_step(engine, step, gas)
        if offload:
            before = engine._core.device_memory["used"]
            engine.offload_states(device=OffloadDeviceEnum.cpu, non_blocking=step % 2 == 1)
            if step % 2 == 0:
                used.append((before, engine._core.device_memory["used"]))
            engine.offload_states()  # a second one moves nothing (waits, returns memory)
            if step == 0:
                # Generation while offloaded reloads the parameters only; they go out again.
                engine.eval()
                with torch.no_grad():
                    engine(*batch(99, 0))
                engine.train()
                engine.offload_states()
                assert engine._core.device_memory["used"] == 16384
            if step % 3 != 2:  # else the next forward reloads
                engine.reload_states(non_blocking=step % 2 == 1)
    return engine.full_state_dict(), used


def test_offload_and_reload_continue_bit_identically_and_free_the_device():
    plain, _ = train(False)
    cycled, used = train(True)
    assert list(plain) == list(cycled)
    for k in plain:
        assert torch.equal(plain[k], cycled[k]), k
    for before, after in used:
        # What stays: the small collectives' scratch (16 KiB).
        assert before > 100000 and after == 16384, (before, after)


def test_the_device_memory_goes_back_to_the_system():
    # ~540k parameters with their states on the device: several 2 MiB chunks of the pool (a
    # 1 GiB budget keeps the chunks at 2 MiB whatever this machine's memory).
    torch.manual_seed(3)
    engine = zinf.initialize(Llama(dim=128, hidden=512),
                             make_config("none", "none", device_budget_bytes=2**30), device="cpu")
    for step in range(2):
        ids, tgt = batch(step, 0)
        engine.backward(engine(ids, tgt))
        engine.step()
        before = engine._core.device_memory
        engine.offload_states(non_blocking=step == 1)
        if step == 1:
            engine.offload_states()  # waits for the non-blocking one, returns the memory
        after = engine._core.device_memory
        # Backed before: everything the engine holds; after: the 2 MiB chunk (two, should it
        # straddle a boundary) holding the 16 KiB scratch.
        assert before["committed"] >= before["used"] > 8 * 2**20, before
        assert after["used"] == 16384 and after["committed"] <= 2 * 2 * 2**20, after
        engine.reload_states()


def train_to_nvme(tiers, folder, offload, steps=4, gas=2):
    torch.manual_seed(11)
    cfg = make_config(tiers, tiers, nvme=str(folder), gas=gas, lr=3e-3)
    # offload_states(device="nvme") writes under the first nvme_path, whatever the tiers.
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(folder)
    engine = zinf.initialize(Llama(), cfg, device="cpu")
    resident = []
    for step in range(steps):
        optimizer_step(engine, step, gas)
        if offload:
            before = engine._core.pinned_memory
            engine.offload_states(device=OffloadDeviceEnum.nvme)
            after = engine._core.pinned_memory
            resident.append((before["resident"], after["resident"], before["used"]))
            assert engine._core.device_memory["used"] == 16384
            assert len(list(folder.glob("offload_states-*"))) == 1
            if step % 2 == 0:  # else the next forward reads it back
                engine.reload_states()
    params = engine.full_state_dict()
    engine.close()
    return params, resident


@pytest.mark.filterwarnings("ignore:zinf config.*used only by offload_states")
@pytest.mark.parametrize("tiers", ["none", "cpu", "nvme"])
def test_offload_to_nvme_releases_the_pinned_memory(tiers, scratch):
    scratch = pathlib.Path(scratch)
    plain, _ = train_to_nvme(tiers, scratch, False)
    cycled, resident = train_to_nvme(tiers, scratch, True)
    for k in plain:
        assert torch.equal(plain[k], cycled[k]), k
    for before, after, used in resident:
        assert before >= used and before > 0 and after == 0, (before, after, used)
    # Its folder went with the engine.
    assert list(scratch.glob("offload_states-*")) == []


def test_include_and_device_are_checked():
    engine = zinf.initialize(Llama(), make_config("none", "none"), device="cpu")
    ids, tgt = batch(0, 0)
    engine.backward(engine(ids, tgt))
    engine.step()
    with pytest.raises(zinf.ZinfError, match="unknown state 'weights'"):
        engine.offload_states(include=["weights"])
    with pytest.raises(zinf.ZinfError, match="include=None"):
        engine.offload_states(include=["lp_params"], device="nvme")
    with pytest.warns(UserWarning, match="nothing to do"):
        engine.offload_states(device=OffloadDeviceEnum.none)
    assert not engine._core.states_offloaded
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states])
    assert engine._core.states_offloaded
    engine.reload_states()
    assert not engine._core.states_offloaded
