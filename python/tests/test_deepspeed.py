"""The DeepSpeed surface: zinf.initialize called DeepSpeed's way returns its 4-tuple and an
engine with its methods and checkpoint shapes; the config's "scheduler" block runs DeepSpeed's
learning-rate schedules (every step's rate equal to a transcription of DeepSpeed's formulas
to 1e-12), stepped at accumulation boundaries, saved in checkpoints; a torch scheduler passed
in is driven the same way; a training script in the shape of DeepSpeed's tutorial runs with
`import zinf as deepspeed`.

The transcription below follows deepspeed/runtime/lr_schedules.py statement by statement
(its classes' state: last_batch_iteration starting at -1, step() after every optimizer step);
zinf's own schedules (zinf/_ds/schedulers.py) are written differently, so the comparison checks
one against the other. 1e-12: both compute in double precision from the same inputs; the
only difference allowed is rounding (the order of a few operations), far below 1e-12 for rates
around 1e-3.
"""
import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import zinf
from conftest import make_config
from models import Llama, batch

HERE = os.path.dirname(os.path.abspath(__file__))

# ---- DeepSpeed's formulas, transcribed ---------------------------------------------------------


class DsWarmupLR:
    def __init__(self, base_lr, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type="log", total_num_steps=None):
        self.min_lr = warmup_min_lr
        self.max_lr = base_lr if warmup_max_lr is None else warmup_max_lr
        self.delta = self.max_lr - self.min_lr
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.warmup_type = warmup_type
        self.total_num_steps = total_num_steps  # WarmupDecayLR when set
        self.last_batch_iteration = -1

    def gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            return self.last_batch_iteration / self.warmup_num_steps
        if self.total_num_steps is None:
            return 1.0
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration) /
                   float(max(1.0, self.total_num_steps - self.warmup_num_steps)))

    def lr(self):
        if self.last_batch_iteration < 0:
            return self.min_lr
        return self.min_lr + self.delta * self.gamma()


class DsWarmupCosineLR:
    def __init__(self, base_lr, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type="log"):
        self.org_lr = base_lr
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.last_batch_iteration = -1

    def lr(self):
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                ratio = self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            else:
                ratio = self.last_batch_iteration / self.warmup_num_steps
            ratio = self.warmup_min_ratio + ratio * (1. - self.warmup_min_ratio)
            return self.org_lr * ratio
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine_progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        ratio = max(0.0, self.cos_min_ratio + (1. - self.cos_min_ratio) * ratio)
        return self.org_lr * ratio


class DsOneCycle:
    def __init__(self, cycle_min_lr, cycle_max_lr, decay_lr_rate=0., cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0,
                 cycle_second_stair_count=None, decay_step_size=0):
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size, self.second_step_size = first, second
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        self.min_lr, self.max_lr, self.decay_lr_rate = cycle_min_lr, cycle_max_lr, decay_lr_rate
        self.last_batch_iteration = -1

    def scale_factor(self):
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1. + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor, stair_count = x / self.step_ratio, self.first_stair_count
        else:
            scale_factor, stair_count = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stair_count > 0:
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                stair_position = cycle_iteration * stair_count / self.first_step_size
            else:
                stair_position = (self.total_size - cycle_iteration) * stair_count / \
                    self.second_step_size
            scale_factor = math.floor(stair_position) / stair_count
        return scale_factor

    def lr(self):
        if self.last_batch_iteration == -1:
            return self.min_lr
        if self.last_batch_iteration < self.total_size:
            return self.min_lr + (self.max_lr - self.min_lr) * self.scale_factor()
        if self.skip_lr_decay:
            return self.min_lr
        decay_interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return self.min_lr / (1 + self.decay_lr_rate * decay_interval)


BASE_LR = 2e-3
SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3, "warmup_num_steps": 7},
     lambda: DsWarmupLR(BASE_LR, 1e-5, 3e-3, 7)),
    ("WarmupLR", {"warmup_num_steps": 5, "warmup_type": "linear"},
     lambda: DsWarmupLR(BASE_LR, 0.0, None, 5, "linear")),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                       "warmup_num_steps": 6},
     lambda: DsWarmupLR(BASE_LR, 0.0, 1e-3, 6, "log", total_num_steps=20)),
    ("WarmupDecayLR", {"total_num_steps": 9, "warmup_num_steps": 4, "warmup_type": "linear",
                       "warmup_max_lr": 5e-4},
     lambda: DsWarmupLR(BASE_LR, 0.0, 5e-4, 4, "linear", total_num_steps=9)),
    ("WarmupCosineLR", {"total_num_steps": 18, "warmup_min_ratio": 0.1, "warmup_num_steps": 5,
                        "cos_min_ratio": 0.05},
     lambda: DsWarmupCosineLR(BASE_LR, 18, 0.1, 5, 0.05)),
    ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 3, "warmup_type": "linear"},
     lambda: DsWarmupCosineLR(BASE_LR, 12, 0.0, 3, 0.0001, "linear")),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 2e-3, "cycle_first_step_size": 5,
                  "cycle_second_step_size": 7, "decay_lr_rate": 0.5, "decay_step_size": 2,
                  "cycle_momentum": False},
     lambda: DsOneCycle(1e-4, 2e-3, 0.5, 5, 7, decay_step_size=2)),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 6,
                  "cycle_first_stair_count": 3, "cycle_second_stair_count": 2,
                  "cycle_momentum": False},
     lambda: DsOneCycle(1e-4, 1e-3, 0., 6, None, 3, 2)),
]


def scheduled_config(kind, params, gas=1, **kw):
    cfg = make_config(lr=BASE_LR, gas=gas, **kw)
    cfg["scheduler"] = {"type": kind, "params": params}
    return cfg


def run_steps(engine, steps, gas=1, first=0):
    """Trains `steps` optimizer steps (on batches first, first + 1, ...); returns the rate
    each optimizer step used (get_lr before the boundary micro-step's forward) and checks it
    holds within a window."""
    used = []
    for step in range(first, first + steps):
        for micro in range(gas):
            if micro == 0:
                used.append(engine.get_lr()[0])
            assert engine.get_lr()[0] == used[-1], "the rate changes only at boundaries"
            assert engine.is_gradient_accumulation_boundary() == (micro == gas - 1)
            ids, tgt = batch(step, micro)
            engine.backward(engine(ids, tgt))
            engine.step()
    return used


@pytest.mark.parametrize("kind,params,reference", SCHEDULES,
                         ids=["%s-%d" % (s[0], i) for i, s in enumerate(SCHEDULES)])
def test_every_schedule_matches_deepspeeds_formula_at_every_step(kind, params, reference):
    torch.manual_seed(0)
    engine, optimizer, _, scheduler = zinf.initialize(model=Llama(), config=scheduled_config(
        kind, params, gas=2))
    assert type(scheduler).__name__ == kind
    steps = 26  # past every warmup, decay end and cycle above
    used = run_steps(engine, steps, gas=2)
    ref = reference()
    want = []
    for _ in range(steps):
        want.append(ref.lr())
        ref.last_batch_iteration += 1  # DeepSpeed steps the schedule after the optimizer step
    worst = max(abs(a - b) for a, b in zip(used, want))
    print("%s %s: max |zinf - DeepSpeed| over %d steps %.3g" % (kind, params, steps, worst))
    assert worst <= 1e-12
    assert optimizer.param_groups[0]["lr"] == engine.get_lr()[0]
    assert scheduler.state_dict() == {"last_batch_iteration": steps - 1}
    assert engine.global_steps == steps


def test_the_scheduled_rate_is_the_one_the_optimizer_uses(scratch):
    """WarmupDecayLR from the config against torch AdamW given the transcription's rate each
    step: the parameters agree within 1e-5 (test_parity.py's tolerance)."""
    params = {"total_num_steps": 10, "warmup_max_lr": 4e-3, "warmup_num_steps": 4}
    torch.manual_seed(1)
    model = Llama()
    ref = copy.deepcopy(model)
    engine, _, _, _ = zinf.initialize(model=model, config=scheduled_config(
        "WarmupDecayLR", params, param="nvme", states="nvme", nvme=scratch))
    opt = torch.optim.AdamW(ref.parameters(), lr=BASE_LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    sched = DsWarmupLR(BASE_LR, 0.0, 4e-3, 4, total_num_steps=10)
    for step in range(12):
        ids, tgt = batch(step)
        engine.backward(engine(ids, tgt))
        engine.step()
        for g in opt.param_groups:
            g["lr"] = sched.lr()
        ref(ids, tgt).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.last_batch_iteration += 1
    got, want = engine.full_state_dict(), ref.state_dict()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    print("WarmupDecayLR against torch AdamW: max |zinf - torch| %.3g" % worst)
    assert worst < 1e-5


def test_the_schedule_is_saved_in_checkpoints_and_resumes_identically(scratch):
    kind, params = "WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 4}
    torch.manual_seed(2)
    model = Llama()
    twin = copy.deepcopy(model)
    engine, _, _, _ = zinf.initialize(model=model, config=scheduled_config(kind, params))
    run_steps(engine, 3)
    assert engine.save_checkpoint(scratch + "/ckpt", client_state={"epoch": 1}) is True
    assert open(scratch + "/ckpt/latest").read() == "global_step3"
    later = run_steps(engine, 4, first=3)
    final = engine.full_state_dict()
    engine.close()

    torch.manual_seed(99)
    other, _, _, sched = zinf.initialize(model=twin, config=scheduled_config(kind, params))
    path, client = other.load_checkpoint(scratch + "/ckpt")
    assert path == scratch + "/ckpt/global_step3" and client == {"epoch": 1}
    assert sched.last_batch_iteration == 2 and other.global_steps == 3
    resumed = run_steps(other, 4, first=3)
    assert resumed == later, "the resumed run uses the rates the first run went on with"
    ref = DsWarmupCosineLR(BASE_LR, 12, warmup_num_steps=4)
    ref.last_batch_iteration = 2
    for lr in resumed:
        assert abs(lr - ref.lr()) <= 1e-12
        ref.last_batch_iteration += 1
    got = other.full_state_dict()
    assert all(torch.equal(got[k], final[k]) for k in final), "bit-identical resume"


def test_a_torch_scheduler_passed_in_is_driven_at_boundaries():
    """A torch LRScheduler, on the trainer's own AdamW (DeepSpeed's client optimizer) or made
    by a factory of zinf's optimizer: stepped after every optimizer step, as torch's would be
    with a plain optimizer."""
    torch.manual_seed(3)
    model = Llama()
    client = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.02)
    sched = torch.optim.lr_scheduler.StepLR(client, step_size=2, gamma=0.5)
    engine, opt, _, got_sched = zinf.initialize(model=model, optimizer=client,
                                                lr_scheduler=sched,
                                                config={"gradient_accumulation_steps": 2,
                                                        "zinf": {"optimizer_threads": 1}})
    assert got_sched is sched
    # zinf's optimizer takes the client optimizer's type and hyperparameters.
    assert engine.config.get("optimizer") == {
        "type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.02,
                                    "betas": [0.9, 0.999]}}
    used = run_steps(engine, 6, gas=2)
    assert used == [1e-3, 1e-3, 5e-4, 5e-4, 2.5e-4, 2.5e-4]
    assert opt.param_groups[0]["weight_decay"] == 0.02
    with pytest.raises(zinf.ZinfError, match="engine.step()"):
        opt.step()

    torch.manual_seed(3)
    factory = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1))  # noqa
    engine, opt, _, sched = zinf.initialize(model=Llama(), lr_scheduler=factory,
                                            config=make_config(lr=1e-3))
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR) and sched.optimizer is opt
    used = run_steps(engine, 4)
    assert used == pytest.approx([1e-3, 5e-4, 1e-3 / 3, 2.5e-4], rel=0, abs=1e-18)


def test_deepspeed_initialize_returns_its_tuple_and_engine_methods(scratch):
    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return batch(i)[0][0], batch(i)[1][0]

    torch.manual_seed(4)
    model = Llama()
    cfg = make_config()
    cfg["train_micro_batch_size_per_gpu"] = 4
    engine, optimizer, loader, scheduler = zinf.initialize(
        model=model, model_parameters=model.parameters(), training_data=Squares(),
        config_params=cfg)
    assert isinstance(engine, zinf.DeepSpeedEngine) and engine.module is model
    assert scheduler is None and isinstance(optimizer, torch.optim.Optimizer)
    assert [len(b[0]) for b in loader] == [4, 4, 2]
    assert engine.train_micro_batch_size_per_gpu() == 4
    assert engine.gradient_accumulation_steps() == 1
    assert engine.zero_optimization_stage() == 3 and engine.zero_optimization_partition_weights()
    ids, tgt = next(iter(loader))
    engine.zero_grad()
    engine.backward(engine(ids, tgt))
    engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()
    assert engine.get_lr() == [pytest.approx(1e-3)]
    # The zinf form keeps returning the engine.
    assert isinstance(zinf.initialize(Llama(), make_config()), zinf.ZinfEngine)
    # The stage is the config's (Hugging Face and accelerate branch on it).
    cfg2 = make_config()
    cfg2["zero_optimization"]["stage"] = 2
    two, _, _, _ = zinf.initialize(model=Llama(), config_params=cfg2)
    assert two.zero_optimization_stage() == 2 and not two.zero_optimization_partition_weights()
    # DeepSpeed's checkpoint shapes: tags, latest, (path, client_state), (None, None).
    assert engine.save_checkpoint(scratch, tag="first", client_state={"n": 1})
    assert engine.save_checkpoint(scratch, client_state={"n": 2})
    assert open(scratch + "/latest").read() == "global_step1"
    assert engine.load_checkpoint(scratch, tag="first") == (scratch + "/first", {"n": 1})
    assert engine.load_checkpoint(scratch) == (scratch + "/global_step1", {"n": 2})
    assert engine.load_checkpoint(scratch + "/nothing") == (None, None)
    with pytest.raises(zinf.ZinfError, match="load_module_only"):
        engine.load_checkpoint(scratch, load_module_only=True)


def test_the_latest_tag_is_refused_and_a_load_never_starts_from_scratch_silently(scratch):
    """Before: tag="latest" wrote into save_dir/latest/, failed with a raw IsADirectoryError,
    left latest.tmp.<pid>, and the next load_checkpoint(save_dir) returned (None, None)."""
    engine, _, _, _ = zinf.initialize(model=Llama(), config=make_config())
    ids, tgt = batch(0)
    engine.backward(engine(ids, tgt))
    engine.step()
    with pytest.raises(zinf.ZinfError, match="tag 'latest' is taken"):
        engine.save_checkpoint(scratch, tag="latest")
    assert not os.path.exists(os.path.join(scratch, "latest"))
    assert [n for n in os.listdir(scratch) if n.startswith("latest")] == []
    # Checkpoints without a `latest` naming one: an error naming them, not (None, None).
    assert engine.save_checkpoint(scratch, tag="a", save_latest=False)
    with pytest.raises(zinf.ZinfError, match=r"holds checkpoints \(a\) but no 'latest'"):
        engine.load_checkpoint(scratch)
    # A `latest` that is not a file: named, on save and on load.
    os.mkdir(os.path.join(scratch, "latest"))
    with pytest.raises(zinf.ZinfError, match="is not a file"):
        engine.save_checkpoint(scratch, tag="b")
    assert [n for n in os.listdir(scratch) if n.startswith("latest.tmp")] == []
    with pytest.raises(zinf.ZinfError, match="is not a file"):
        engine.load_checkpoint(scratch)
    assert engine.load_checkpoint(scratch, tag="a")[0] == os.path.join(scratch, "a")


def test_a_subset_of_parameters_trains_and_the_rest_stay(scratch):
    torch.manual_seed(5)
    model = Llama()
    frozen_before = model.embed_tokens.weight.detach().clone()
    trained = [p for n, p in model.named_parameters() if not n.startswith("embed_tokens")]
    engine, _, _, _ = zinf.initialize(model=model, model_parameters=trained,
                                      config=make_config(lr=1e-2))
    for step in range(2):
        ids, tgt = batch(step)
        engine.backward(engine(ids, tgt))
        engine.step()
    assert torch.equal(engine.gather(model.embed_tokens.weight), frozen_before)
    assert engine.param_updates(model.lm_head.weight) == 2


def test_scheduler_config_errors_name_the_key():
    cases = [({"type": "Cyclic", "params": {}}, "scheduler.type"),
             ({"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
              "scheduler.params.warmup_max_lr: 'auto'"),
             ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
              "scheduler.params.warmup_num_steps"),
             ({"type": "WarmupDecayLR", "params": {}}, "total_num_steps: required"),
             ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}},
              "cycle_momentum"),
             ({"type": "WarmupLR", "params": {"warmup_steps": 3}}, "unknown key")]
    for block, match in cases:
        cfg = make_config()
        cfg["scheduler"] = block
        with pytest.raises(zinf.ZinfError, match=match) as e:
            zinf.initialize(model=Llama(), config=cfg)
        assert e.value.code == "InvalidArgument"


def test_a_deepspeed_tutorial_script_runs_with_import_zinf_as_deepspeed(scratch):
    """python/tests/ds_tutorial.py: the shape of DeepSpeed's getting-started tutorial
    (add_config_arguments, init_distributed, initialize with args/model/model_parameters/
    training_data, model_engine(batch), backward, step, save_checkpoint with a tag and
    client_state, load_checkpoint), run twice: the second run resumes from the first's
    checkpoint."""
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                                   "nvme_path": scratch}},
           "steps_per_print": 10, "zinf": {"optimizer_threads": 1}}
    with open(scratch + "/ds_config.json", "w") as f:
        json.dump(cfg, f)

    def run(*extra):
        r = subprocess.run([sys.executable, os.path.join(HERE, "ds_tutorial.py"), "--deepspeed",
                            "--deepspeed_config", scratch + "/ds_config.json", "--save_dir",
                            scratch + "/ckpt"] + list(extra), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=300)
        assert r.returncode == 0, r.stdout
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = run("--epochs", "2")
    assert first["start_step"] == 0 and first["steps"] == 8
    assert first["last_loss"] < first["first_loss"]
    assert first["global_steps"] == 4  # 8 micro-steps, accumulation 2
    second = run("--epochs", "1", "--load_dir", scratch + "/ckpt")
    assert second["start_step"] == 8 and second["global_steps"] == 6
    # WarmupLR over 4 steps, warmup_max_lr the optimizer's 3e-3: reached after step 4.
    assert second["lr"] == pytest.approx(3e-3, rel=1e-12)


def test_batch_arithmetic_is_deepspeeds():
    """train = micro x accumulation x ranks; any two give the third; an inconsistent triple is
    refused with the numbers (DeepSpeed's _set_batch_related_parameters)."""
    from zinf._config import Config, resolve_batch

    def resolved(world, **keys):
        c = resolve_batch(Config(dict(make_config(), **keys)), world)
        return (c.summary["train_batch_size"], c.summary["train_micro_batch_size_per_gpu"],
                c.summary["gradient_accumulation_steps"])

    base = make_config()
    del base["gradient_accumulation_steps"]

    def only(world, **keys):
        c = resolve_batch(Config(dict(base, **keys)), world)
        return (c.summary["train_batch_size"], c.summary["train_micro_batch_size_per_gpu"],
                c.summary["gradient_accumulation_steps"])

    assert only(2, train_batch_size=16) == (16, 8, 1)
    assert only(1, train_batch_size=16, train_micro_batch_size_per_gpu=8) == (16, 8, 2)
    assert only(2, train_batch_size=16, train_micro_batch_size_per_gpu=4) == (16, 4, 2)
    assert only(2, train_batch_size=32, gradient_accumulation_steps=4) == (32, 4, 4)
    assert only(2, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=5) == (30, 3, 5)
    assert only(4, train_micro_batch_size_per_gpu=3) == (12, 3, 1)
    # make_config sets accumulation 1: a triple that does not multiply out.
    with pytest.raises(zinf.ZinfError, match=r"16 != 4 x 1 x 2"):
        resolved(2, train_batch_size=16, train_micro_batch_size_per_gpu=4)
    with pytest.raises(zinf.ZinfError, match="16 is not a multiple of"):
        only(2, train_batch_size=16, train_micro_batch_size_per_gpu=3)
    with pytest.raises(zinf.ZinfError, match="train_batch_size: \"auto\""):
        only(1, train_batch_size="auto")
    # The engine and its accessors carry the resolved numbers.
    torch.manual_seed(3)
    engine, _, _, _ = zinf.initialize(model=Llama(), config=dict(
        base, train_batch_size=16, train_micro_batch_size_per_gpu=8))
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps()) == (16, 8, 2)
