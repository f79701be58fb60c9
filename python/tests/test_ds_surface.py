"""zinf's `deepspeed` package (zinf/compat): every name that accelerate, transformers, peft and
DeepSpeed-Chat import or call resolves (the list below was read from their sources), and each
behaves as DeepSpeed documents it, or is refused naming what zinf does instead."""
import importlib
import subprocess
import sys

import pytest
import torch

import zinf
import zinf.launch
from conftest import make_config
from models import Llama, batch

sys.path.insert(0, zinf.launch.deepspeed_path())
import deepspeed  # noqa: E402

# The names the integrations use, as (module, attribute).
def names():
    out = [("deepspeed", n) for n in (
        "initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine",
        "DeepSpeedConfig", "zero", "comm", "checkpointing", "__version__", "__zinf__")]
    out += [("deepspeed.accelerator", "get_accelerator")]
    out += [("deepspeed.comm", n) for n in (
        "is_initialized", "init_distributed", "get_rank", "get_world_size", "get_local_rank",
        "barrier", "all_reduce", "broadcast", "all_gather", "ReduceOp")]
    out += [("deepspeed.zero", n) for n in ("Init", "GatheredParameters")]
    out += [("deepspeed.ops.adam", n) for n in ("DeepSpeedCPUAdam", "FusedAdam")]
    out += [("deepspeed.ops.adagrad", "DeepSpeedCPUAdagrad"),
            ("deepspeed.ops.lion", "DeepSpeedCPULion")]
    out += [("deepspeed.utils", n) for n in (
        "logger", "safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_grad",
        "set_z3_leaf_modules")]
    out += [("deepspeed.runtime.lr_schedules", "VALID_LR_SCHEDULES"),
            ("deepspeed.runtime.engine", "DeepSpeedEngine"),
            ("deepspeed.runtime.zero.partition_parameters", "ZeroParamStatus"),
            ("deepspeed.runtime.zero.offload_config", "OffloadDeviceEnum"),
            ("deepspeed.checkpoint.utils", "clone_tensors_for_torch_save"),
            ("deepspeed.compression.helper", "recursive_getattr"),
            ("deepspeed.compression.helper", "recursive_setattr"),
            ("deepspeed.moe.utils", "split_params_into_different_moe_groups_for_optimizer"),
            ("deepspeed.moe.utils", "is_moe_param"),
            ("deepspeed.launcher.runner", "DEEPSPEED_ENVIRONMENT_NAME"),
            ("deepspeed.utils.zero_to_fp32", "get_fp32_state_dict_from_zero_checkpoint")]
    return out


ENGINE_METHODS = ("backward", "step", "set_gradient_accumulation_boundary",
                  "get_global_grad_norm", "zero_gather_16bit_weights_on_model_save",
                  "_zero3_consolidated_16bit_state_dict", "save_checkpoint", "load_checkpoint",
                  "bfloat16_enabled", "fp16_enabled", "destroy", "train_batch_size",
                  "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "is_gradient_accumulation_boundary", "get_lr", "was_step_applied",
                  "zero_optimization_stage", "save_16bit_model", "train", "eval", "zero_grad",
                  "offload_states", "reload_states")


def test_every_name_resolves_and_says_it_is_zinf():
    for module, name in names():
        assert hasattr(importlib.import_module(module), name), "%s.%s" % (module, name)
    assert deepspeed.__zinf__ == zinf.__version__
    assert deepspeed.__file__.startswith(zinf.launch.deepspeed_path())
    for m in ENGINE_METHODS:
        assert callable(getattr(deepspeed.DeepSpeedEngine, m)), m
    assert "WarmupLR" in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES


def engine_of(model, **config):
    return deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                config=dict(make_config(), **config))[0]


def test_gathered_parameters_and_the_zero3_attributes(scratch):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    torch.manual_seed(2)
    model = Llama()
    engine = engine_of(model)
    w = model.lm_head.weight
    assert w.ds_id == engine._registry.managed(w).id
    assert w.ds_numel == w.numel() and tuple(w.ds_shape) == tuple(w.shape)
    assert w.ds_status == ZeroParamStatus.NOT_AVAILABLE
    before = engine.gather(w)
    # Without modifier_rank the block's writes are dropped, as in DeepSpeed.
    with deepspeed.zero.GatheredParameters([w, None, torch.nn.Parameter(torch.ones(2))]):
        assert w.ds_status == ZeroParamStatus.AVAILABLE
        assert torch.equal(w.data, before)
        w.data.fill_(3.0)
    assert torch.equal(engine.gather(w), before)
    # With modifier_rank the write reaches the fp32 master, and training goes on from it.
    with deepspeed.zero.GatheredParameters(iter([w]), modifier_rank=0):
        w.data.mul_(0.5)
    assert torch.equal(engine.gather(w), before * 0.5)
    with deepspeed.zero.GatheredParameters([], enabled=False):
        pass
    engine.backward(engine(*batch(0)))
    engine.step()
    assert not torch.equal(engine.gather(w), before * 0.5)
    with pytest.raises(zinf.ZinfError, match="fwd_module"):
        deepspeed.zero.GatheredParameters([w], fwd_module=model)


def test_engine_methods_behave_as_deepspeeds(scratch):
    torch.manual_seed(3)
    model = Llama()
    engine = engine_of(model, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
                       zero_optimization=dict(make_config()["zero_optimization"],
                                              stage3_gather_16bit_weights_on_model_save=True))
    assert engine.zero_gather_16bit_weights_on_model_save()
    assert engine.bfloat16_enabled() is False and engine.fp16_enabled() is False
    assert engine.embed_tokens is model.embed_tokens  # unknown attributes: the module's
    engine.set_gradient_accumulation_boundary(True)  # but this is micro-step 1 of 2
    engine.backward(engine(*batch(0)))
    with pytest.raises(zinf.ZinfError, match="micro-step 1 of 2"):
        engine.step()
    state = engine._zero3_consolidated_16bit_state_dict()
    full = engine.full_state_dict()
    assert list(state) == list(full) and all(torch.equal(state[k], full[k]) for k in full)
    assert deepspeed.accelerator.get_accelerator().memory_allocated() > 0
    engine.destroy()
    assert engine._closed


def test_deepspeed_cpu_adam_stepped_directly_is_torchs():
    torch.manual_seed(4)
    a = torch.nn.Parameter(torch.randn(5))
    b = torch.nn.Parameter(a.detach().clone())
    opt = deepspeed.ops.adam.DeepSpeedCPUAdam([a], lr=0.1, weight_decay=0.01)
    ref = torch.optim.AdamW([b], lr=0.1, weight_decay=0.01)
    for _ in range(3):
        a.grad = torch.arange(5.0)
        b.grad = torch.arange(5.0)
        opt.step()
        ref.step()
    assert torch.equal(a, b)
    with pytest.raises(zinf.ZinfError, match="amsgrad"):
        deepspeed.ops.adam.FusedAdam([a], amsgrad=True)


def test_init_distributed_with_one_rank_makes_a_process_group():
    code = ("import sys; sys.path.insert(0, %r); import deepspeed, torch.distributed as d; "
            "deepspeed.init_distributed(); print(d.get_rank(), d.get_world_size())"
            % zinf.launch.deepspeed_path())
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1"]


def test_gathered_parameters_edges(scratch):
    torch.manual_seed(5)
    model = Llama()
    engine = engine_of(model, bf16={"enabled": True})
    w, emb = model.lm_head.weight, model.embed_tokens.weight
    assert w.shape == emb.shape
    master = engine.gather(w)
    # bf16: a write to one element changes that element of the fp32 master alone.
    with deepspeed.zero.GatheredParameters([w], modifier_rank=0):
        assert w.data.dtype == torch.bfloat16
        w.data[0, 0] = 2.0
    after = engine.gather(w)
    want = master.clone()
    want[0, 0] = 2.0
    assert torch.equal(after, want)
    # A call mixing a gathered parameter and a managed one reads the other through the engine.
    # (Elements whose bf16 value the write leaves as it was keep their fp32 master.)
    before = engine.gather(w)
    written = engine.gather(emb).to(torch.bfloat16)
    with torch.no_grad(), deepspeed.zero.GatheredParameters([w], modifier_rank=0):
        w.copy_(emb)
    same = before.to(torch.bfloat16) == written
    assert 0 < int(same.sum()) < same.numel()
    assert torch.equal(engine.gather(w), torch.where(same, before, written.float()))
    # No forward inside a block; the block's parameters are whole afterwards.
    with pytest.raises(zinf.ZinfError, match="inside GatheredParameters"):
        with deepspeed.zero.GatheredParameters([w]):
            engine(*batch(0))
    engine.backward(engine(*batch(0)))
    engine.step()
    # A parameter built under zero.Init holds no values before initialize.
    with deepspeed.zero.Init(config_dict_or_path=make_config(), enabled=True) as init:
        lin = torch.nn.Linear(4, 4)
    assert init.parameters == 2
    with pytest.raises(zinf.ZinfError, match="before initialize"):
        deepspeed.zero.GatheredParameters([lin.weight]).__enter__()


def test_zero_init_takes_the_quantized_gathers_from_the_config(scratch):
    """zero.Init(zero_quantized_weights=True) is what the config says: accepted when the config
    sets it (the engine's gathers then send int8 blocks: zero_optimization.zero_quantized_weights
    reaches the parsed config), refused naming the key when it does not (it would be ignored)."""
    config = make_config()
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        with pytest.raises(zinf.ZinfError, match=key):
            deepspeed.zero.Init(config_dict_or_path=config, **{key: True})
        with pytest.raises(zinf.ZinfError, match=key):
            deepspeed.zero.Init(**{key: True})
    config["zero_optimization"]["zero_quantized_weights"] = True
    with deepspeed.zero.Init(config_dict_or_path=config, zero_quantized_weights=True) as init:
        torch.nn.Linear(4, 4)
    assert init.parameters == 2
    from zinf._config import Config
    assert Config(config).summary["zero_optimization.zero_quantized_weights"] is True



def test_the_zeropp_keys_reach_the_engine_config():
    """DeepSpeed's ZeRO++ keys (qwZ, qgZ, hpZ) are the engine's: parsed as the engine parses
    them (an hpZ size of 0 refused naming the key), and on one rank without effect."""
    from zinf._config import Config
    config = make_config()
    config["zero_optimization"].update({"stage": 3, "zero_hpz_partition_size": 2,
                                        "zero_quantized_gradients": True})
    summary = Config(config).summary
    assert summary["zero_optimization.zero_hpz_partition_size"] == 2
    assert summary["zero_optimization.zero_quantized_gradients"] is True
    # zinf's own key for qgZ's code: int4 blocks, and nothing but 8 or 4.
    config.setdefault("zinf", {})["quantized_gradient_bits"] = 4
    assert Config(config).summary["quantized_gradient_bits"] == 4
    config["zinf"]["quantized_gradient_bits"] = 2
    with pytest.raises(zinf.ZinfError, match="quantized_gradient_bits"):
        Config(config)
    config["zinf"]["quantized_gradient_bits"] = 8
    # The values per scale of the quantized collectives' blocks: powers of two, 64 to 1024.
    assert Config(config).summary["quantization_block_size"] == 256
    config["zinf"]["quantization_block_size"] = 64
    assert Config(config).summary["quantization_block_size"] == 64
    config["zinf"]["quantization_block_size"] = 100
    with pytest.raises(zinf.ZinfError, match="quantization_block_size"):
        Config(config)
    config["zinf"]["quantization_block_size"] = 256
    config["zero_optimization"]["zero_hpz_partition_size"] = 0
    with pytest.raises(zinf.ZinfError, match="zero_hpz_partition_size"):
        Config(config)