"""zinf.Init and Hugging Face safetensors checkpoints: a model built partition by partition and
loaded tensor by tensor stays within a bounded host memory; loads are exact; exports round
trip exactly; a bad checkpoint is one clear error that changes nothing; zinf.Init intercepts
only the modules its own thread builds."""
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import zinf
from conftest import make_config
from models import Llama, Quirky
from st_writer import read_file, write_file, write_sharded

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


def test_init_and_a_sharded_load_stay_within_the_memory_bound(scratch):
    """A 57M-parameter Llama (226 MB of fp32 parameters, 905 MB with its AdamW states) built
    under zinf.Init and loaded from a 3-shard checkpoint (F32, BF16 and F16 tensors).

    The bound: the pinned budget (192 MiB, allocated and locked whole), plus three times the
    largest tensor (the engine's full-tensor buffer while loading, a read block, torch's tensor
    while a module is built), plus 64 MiB for the allocator and Python. Materialising the
    parameters alone would exceed it by far less than the states would: the point is that the
    growth does not scale with the model."""
    sys.path.insert(0, HERE)
    from init_worker import SHAPE

    torch.manual_seed(21)
    model = Llama(**SHAPE)
    tensors = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if name == "embed_tokens.weight":
            t = t.to(torch.bfloat16)
        elif name == "lm_head.weight":
            t = t.to(torch.float16)
        tensors[name] = t
    largest = max(p.numel() for p in model.parameters()) * 4
    del model
    os.mkdir(scratch + "/ckpt")
    write_sharded(scratch + "/ckpt", tensors, shards=3)
    del tensors
    r = subprocess.run([sys.executable, os.path.join(HERE, "init_worker.py"), scratch + "/ckpt",
                        scratch + "/work"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout
    result = json.loads(r.stdout.strip().splitlines()[-1])
    growth = result["peak_rss"] - result["baseline_rss"]
    bound = 192 * MiB + 3 * largest + 64 * MiB
    model_bytes = result["params"] * 16  # fp32 parameters + master + two moments
    print("zinf.Init + load_safetensors: %d parameters (%.0f MB with states), peak RSS growth "
          "%.0f MiB (bound %.0f MiB), %d shards exported"
          % (result["params"], model_bytes / 1e6, growth / MiB, bound / MiB, result["shards"]))
    assert result["spilled"] == result["loaded"] == len(list(Llama(**SHAPE).parameters()))
    assert result["shards"] >= 3
    assert growth < bound
    assert bound < model_bytes / 2


def small_checkpoint(model, path, rename=lambda n: n, dtype=None):
    tensors = {}
    for name, p in model.named_parameters():
        t = p.detach().clone() * 2 + 1  # values a fresh model does not have
        tensors[rename(name)] = t.to(dtype) if dtype else t
    write_file(path, tensors)
    return tensors


def states_equal(a, b):
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_load_with_a_name_map_then_export_and_load_back(scratch):
    torch.manual_seed(1)
    model = Llama()
    engine = zinf.initialize(model, make_config("cpu", "nvme", nvme=scratch))
    tensors = small_checkpoint(Llama(), scratch + "/hf.safetensors", rename=lambda n: "model." + n)
    report = zinf.load_safetensors(engine, scratch + "/hf.safetensors",
                                   name_map=lambda n: "model." + n)
    assert report["missing"] == [] and report["unexpected"] == []
    got = engine.full_state_dict()
    for name in got:
        assert torch.equal(got[name], tensors["model." + name]), name
    zinf.save_safetensors(engine, scratch + "/export", shard_size=4096, dtype=torch.float32)
    index = json.load(open(scratch + "/export/model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(got)
    exported = {}
    for f in set(index["weight_map"].values()):
        exported.update(read_file(scratch + "/export/" + f))
    assert states_equal({k: exported[k] for k in got}, got)
    other = zinf.initialize(Llama(), make_config())
    zinf.load_safetensors(other, scratch + "/export")
    assert states_equal(other.full_state_dict(), got)
    # bf16 export: the masters rounded to nearest even.
    zinf.save_safetensors(engine, scratch + "/bf16", dtype=torch.bfloat16)
    half = read_file(scratch + "/bf16/model.safetensors")
    assert all(torch.equal(half[k], got[k].to(torch.bfloat16)) for k in got)


def test_tied_weights_load_under_any_of_their_names(scratch):
    from models import Gpt2
    torch.manual_seed(1)
    model = Gpt2()
    engine = zinf.initialize(model, make_config())
    tensors = {n: p.detach() * 0 + 0.5 for n, p in Gpt2().named_parameters()}
    tensors["lm_head.weight"] = tensors.pop("wte.weight")  # the checkpoint names the head
    write_file(scratch + "/m.safetensors", tensors)
    zinf.load_safetensors(engine, scratch + "/m.safetensors",
                          name_map={"wte.weight": "lm_head.weight"})
    assert torch.equal(engine.gather(model.wte.weight), tensors["lm_head.weight"])


@pytest.fixture
def loaded_engine(scratch):
    torch.manual_seed(1)
    model = Llama()
    engine = zinf.initialize(model, make_config("nvme", "nvme", nvme=scratch))
    yield engine, engine.full_state_dict()
    engine.close()


def test_a_checkpoint_of_another_shape_is_refused_whole(scratch, loaded_engine):
    engine, before = loaded_engine
    small_checkpoint(Llama(hidden=96), scratch + "/other.safetensors")
    with pytest.raises(zinf.ZinfError, match=r"shape \[96, 32\].*shape \[64, 32\]") as e:
        zinf.load_safetensors(engine, scratch + "/other.safetensors")
    assert e.value.code == "InvalidArgument"
    assert states_equal(engine.full_state_dict(), before)


def test_a_missing_shard_is_named_and_nothing_loads(scratch, loaded_engine):
    engine, before = loaded_engine
    os.mkdir(scratch + "/ckpt")
    write_sharded(scratch + "/ckpt", {n: p * 3 for n, p in before.items()}, shards=3)
    os.unlink(scratch + "/ckpt/model-00002-of-00003.safetensors")
    with pytest.raises(zinf.ZinfError, match="model-00002-of-00003.safetensors") as e:
        zinf.load_safetensors(engine, scratch + "/ckpt")
    assert e.value.code == "NotFound"
    assert states_equal(engine.full_state_dict(), before)


def test_a_truncated_header_is_named_and_nothing_loads(scratch, loaded_engine):
    engine, before = loaded_engine
    path = scratch + "/cut.safetensors"
    small_checkpoint(Llama(), path)
    with open(path, "r+b") as f:
        f.truncate(100)  # inside the JSON header
    with pytest.raises(zinf.ZinfError, match="truncated") as e:
        zinf.load_safetensors(engine, path)
    assert "cut.safetensors" in str(e.value)
    assert states_equal(engine.full_state_dict(), before)


def test_a_dtype_the_model_does_not_have_is_refused(scratch, loaded_engine):
    engine, before = loaded_engine
    tensors = {n: p for n, p in before.items()}
    tensors["norm.weight"] = torch.ones(32, dtype=torch.int64)
    write_file(scratch + "/ints.safetensors", tensors)
    with pytest.raises(zinf.ZinfError, match="I64"):
        zinf.load_safetensors(engine, scratch + "/ints.safetensors")
    assert states_equal(engine.full_state_dict(), before)


def test_strict_names_and_a_partial_load(scratch, loaded_engine):
    engine, before = loaded_engine
    tensors = {n: p + 1 for n, p in before.items() if n != "lm_head.weight"}
    tensors["extra.weight"] = torch.zeros(3)
    write_file(scratch + "/partial.safetensors", tensors)
    with pytest.raises(zinf.ZinfError, match="'lm_head.weight'.*'extra.weight'"):
        zinf.load_safetensors(engine, scratch + "/partial.safetensors")
    assert states_equal(engine.full_state_dict(), before)
    report = zinf.load_safetensors(engine, scratch + "/partial.safetensors", strict=False)
    assert report["missing"] == ["lm_head.weight"]
    assert report["unexpected"] == ["extra.weight"]
    after = engine.full_state_dict()
    assert torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    assert torch.equal(after["norm.weight"], before["norm.weight"] + 1)


def test_init_keeps_constructor_initialisation_and_refuses_later_changes(scratch):
    cfg = make_config()
    torch.manual_seed(4)
    reference = Quirky()
    torch.manual_seed(4)
    with zinf.Init(cfg, spill_dir=scratch) as init:
        model = Quirky()
    assert init.parameters == 7
    assert all(p.stride() == (0,) * p.dim() for p in model.parameters())
    assert not model.embed.weight.requires_grad  # set in the constructor, kept
    engine = zinf.initialize(model, cfg)
    got = engine.full_state_dict()
    assert states_equal(got, reference.state_dict())

    with zinf.Init(cfg, spill_dir=scratch):
        changed = Quirky()
    with torch.no_grad():
        changed.head.bias.zero_()  # after the constructor: the value is already in the spill
    with pytest.raises(zinf.ZinfError, match="'head.bias' was changed in place"):
        zinf.initialize(changed, cfg)
    with zinf.Init(cfg, spill_dir=scratch):
        changed = Quirky()
    changed.shared.weight.data.fill_(0.5)  # through .data: no version change, still caught
    with pytest.raises(zinf.ZinfError, match="'shared.weight' was changed in place"):
        zinf.initialize(changed, cfg)


def test_init_leaves_modules_other_threads_build_alone(scratch):
    started, go, built = threading.Event(), threading.Event(), {}

    def other_thread():
        started.set()
        go.wait()
        torch.manual_seed(3)
        built["module"] = torch.nn.Linear(8, 8)

    t = threading.Thread(target=other_thread)
    t.start()
    started.wait()
    with zinf.Init(make_config(), spill_dir=scratch) as init:
        go.set()
        t.join()  # built while this thread's Init is entered
        mine = torch.nn.Linear(8, 8)
    torch.manual_seed(3)
    want = torch.nn.Linear(8, 8)
    other = built["module"]
    assert torch.equal(other.weight, want.weight) and torch.equal(other.bias, want.bias)
    assert other.weight.stride() == (8, 1), "an ordinary module, with memory of its own"
    assert init.parameters == 2, "only this thread's Linear was spilled"
    assert mine.weight.stride() == (0, 0)
    assert torch.nn.Linear.__init__ is torch.nn.Linear.__dict__["__init__"]
    assert not hasattr(torch.nn.Linear.__init__, "__wrapped__"), "unpatched after the exit"
