"""A DeepSpeed training script run unchanged under `python3 -m zinf.launch` (python/examples/
ds_train.py: grouped DeepSpeedCPUAdam, a torch LambdaLR, zero.Init, GatheredParameters with
modifier_rank, accelerator and comm queries, tagged checkpoints, batch sizes as two of three) on
1 and 2 processes: every weight within 1e-5 of torch's AdamW over the same groups, schedule and
global batches (test_parity.py's tolerance and reason: two kernels evaluating one formula in a
different order; with 2 ranks also the gradient summed over the ranks instead of over one
batch), DeepSpeed's batch arithmetic (train = micro x accumulation x ranks), and a run resumed
from a tagged checkpoint ending bit-identical to the run that went through.
"""
import importlib.metadata
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import zinf.launch

ROOT = os.environ.get("ZINF_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "python", "examples", "ds_train.py")
TOL = 1e-5

sys.path.insert(0, zinf.launch.deepspeed_path())
sys.path.insert(0, os.path.dirname(SCRIPT))
import ds_train  # noqa: E402  (imports zinf's deepspeed, from the folder above)


def write_config(folder, **batch):
    cfg = dict(batch, zero_optimization={"stage": 3, "offload_param": {"device": "cpu"},
                                         "offload_optimizer": {"device": "cpu"}},
               zinf={"pinned_budget_bytes": "64M", "optimizer_threads": 1,
                     "collective_timeout_seconds": 60})
    path = os.path.join(folder, "ds_config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def launch(nproc, folder, *args, timeout=300):
    """Runs the script under zinf.launch; returns rank 0's JSON line."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "zinf.launch", "--nproc_per_node", str(nproc), SCRIPT] + \
        list(args)
    p = subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError("timed out: %s" % err.decode(errors="replace")[-4000:])
    text = out.decode(errors="replace")
    assert p.returncode == 0, text[-3000:] + err.decode(errors="replace")[-6000:]
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


def reference(world, micro, gas, steps, lr=5e-3):
    """torch's AdamW over the same groups, schedule and global batches."""
    model = ds_train.build_model()
    with torch.no_grad():
        model.head.bias.fill_(0.25)
    opt = torch.optim.AdamW(ds_train.optimizer_groups(model), lr=lr, betas=(0.9, 0.95),
                            eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, ds_train.schedule)
    for step in range(steps):
        for m in range(gas):
            parts = [ds_train.rows(step, m, r, micro) for r in range(world)]
            x = torch.cat([p[0] for p in parts])
            y = torch.cat([p[1] for p in parts])
            (F.cross_entropy(model(x), y) / gas).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return {n: p.detach() for n, p in model.named_parameters()}, [g["lr"] for g in
                                                                  opt.param_groups]


@pytest.mark.parametrize("nproc,batch,expect", [
    (1, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8}, [16, 8, 2]),
    (2, {"train_batch_size": 16, "gradient_accumulation_steps": 2}, [16, 4, 2]),
    (2, {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, [16, 4, 2]),
], ids=["1proc-train-micro", "2proc-train-gas", "2proc-micro-gas"])
def test_a_deepspeed_script_runs_unchanged_and_matches_torch(nproc, batch, expect, scratch):
    cfg = write_config(scratch, **batch)
    line = launch(nproc, scratch, "--deepspeed_config", cfg, "--steps", "6", "--out", "w.pt")
    assert line["zinf"] == zinf.__version__ and line["deepspeed"].endswith("+zinf")
    assert line["world"] == nproc and line["batch"] == expect
    assert line["global_steps"] == 6 and line["device"] == "cpu"
    assert line["memory_allocated"] > 0  # the engine's device budget in use
    got = torch.load(os.path.join(scratch, "w.pt"))
    want, lrs = reference(nproc, expect[1], expect[2], 6)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    print("max |zinf - torch| of ds_train.py on %d process(es): %.3g" % (nproc, worst))
    assert worst < TOL
    assert line["lr"] == pytest.approx(lrs, rel=1e-12)
    assert line["losses"][-1] < line["losses"][0]


def test_a_tagged_checkpoint_resumes_bit_identically_on_two_processes(scratch):
    cfg = write_config(scratch, train_batch_size=16, gradient_accumulation_steps=2)
    ckpt = os.path.join(scratch, "ckpt")
    straight = launch(2, scratch, "--deepspeed_config", cfg, "--steps", "6", "--save_dir", ckpt,
                      "--save_at", "3", "--out", "a.pt")
    assert sorted(os.listdir(ckpt)) == ["latest", "step3"]
    resumed = launch(2, scratch, "--deepspeed_config", cfg, "--steps", "6", "--load_dir", ckpt,
                     "--tag", "step3", "--out", "b.pt")
    a = torch.load(os.path.join(scratch, "a.pt"))
    b = torch.load(os.path.join(scratch, "b.pt"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["lr"] == straight["lr"] and resumed["global_steps"] == 6
    assert resumed["losses"] == straight["losses"][len(straight["losses"]) - len(
        resumed["losses"]):]


def test_the_deepspeed_path_holds_the_package_and_a_version_the_integrations_accept():
    out = subprocess.run([sys.executable, "-m", "zinf.launch", "--deepspeed-path"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == zinf.launch.deepspeed_path()
    assert os.path.isfile(os.path.join(out, "deepspeed", "__init__.py"))
    dists = [d for d in importlib.metadata.distributions(path=[out])
             if d.metadata["Name"] == "deepspeed"]
    assert len(dists) == 1
    version = tuple(int(x) for x in dists[0].version.split("+")[0].split("."))
    assert version >= (0, 9, 3)  # accelerate's and transformers' minimum
    import deepspeed
    assert deepspeed.__file__.startswith(out)


def test_inconsistent_batch_sizes_are_refused_on_every_rank(scratch):
    cfg = write_config(scratch, train_batch_size=16, train_micro_batch_size_per_gpu=4,
                       gradient_accumulation_steps=4)
    cmd = [sys.executable, "-m", "zinf.launch", "--nproc_per_node", "2", SCRIPT,
           "--deepspeed_config", cfg, "--steps", "1"]
    p = subprocess.run(cmd, cwd=scratch, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert p.stderr.count("16 != 4 x 4 x 2") >= 2, p.stderr[-4000:]


def test_the_launcher_picks_a_local_port_only_where_nothing_says_where_ranks_meet():
    argv = zinf.launch.torchrun_argv
    got = argv(["--nproc_per_node", "2", "t.py", "--master_port", "5"])
    assert got[:3] == ["--master_addr", "127.0.0.1", "--master_port"] and \
        got[4:] == ["--nproc_per_node", "2", "t.py", "--master_port", "5"]
    assert argv(["--nproc_per_node=2", "t.py"])[:2] == ["--master_addr", "127.0.0.1"]
    for given in (["--master_addr", "h", "--nnodes", "2", "t.py"], ["--standalone", "t.py"],
                  ["--nnodes=2", "--rdzv_endpoint", "h:1", "t.py"],
                  ["--master_port", "29501", "t.py"], ["--master-addr=h", "t.py"]):
        assert argv(given) == given, given
