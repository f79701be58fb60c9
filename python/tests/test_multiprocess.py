"""Ranks as processes (issue 29): torchrun starts N ranks of a zinf training script; ZeRO-3
across them (gloo) trains every parameter within 1e-5 of torch AdamW on the concatenated batch
(gradients averaged over the ranks, as DeepSpeed's); a rank killed mid-run makes the others
fail with a message naming it, within seconds, instead of hanging.
"""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from mp_worker import model_and_data  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mp_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env():
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = "1"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        e.pop(k, None)
    return e


def run_group(cmd, timeout=300, merge=True):
    """Runs a launcher in its own session; on timeout its whole process group (the launcher's
    workers too) is killed, so no rank outlives the test. Returns (returncode, out, err)."""
    p = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT if merge else subprocess.PIPE,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError("timed out after %d s: %s" % (timeout, out[-4000:]))
    return p.returncode, out.decode(errors="replace"), (err or b"").decode(errors="replace")


def torchrun(nproc, args, timeout=300):
    # zinf.torchrun: torch.distributed.run itself, with Debian 12's Python 3.11 fix. The
    # workers' collective timeout is short, so a stuck rank fails well within the test's.
    cmd = [sys.executable, "-m", "zinf.torchrun", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), WORKER,
           "--timeout", "60"] + args
    rc, out, _ = run_group(cmd, timeout)
    assert rc == 0, out[-6000:]
    return out


def read_safetensors(path):
    """{name: float32 tensor} of a safetensors file (read here, independently of zinf)."""
    import json
    import struct
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        assert v["dtype"] == "F32", (name, v["dtype"])
        a, b = v["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[a:b]), dtype=torch.float32).reshape(v["shape"])
    return out


def reference(steps, clip=0.0):
    """torch AdamW on the whole batch, mean loss: what N ranks with averaged gradients do."""
    model, x, y = model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                    clip if clip > 0 else float("inf")).item())
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses, norms


@pytest.mark.parametrize("nproc,states", [(2, "cpu"), (2, "nvme"), (4, "cpu")])
def test_torchrun_matches_torch_adamw(scratch, nproc, states):
    out = os.path.join(scratch, "out")
    args = ["--states", states, "--out", out, "--steps", "5"]
    if states == "nvme":
        os.makedirs(os.path.join(scratch, "swap"))
        args += ["--param", "nvme", "--nvme", os.path.join(scratch, "swap")]
    torchrun(nproc, args)
    got = torch.load(out + ".pt")
    want, want_losses, _ = reference(5)
    for name, w in want.items():
        diff = (got["state"][name] - w).abs().max().item()
        assert diff <= 1e-5, "%s differs from torch AdamW by %g" % (name, diff)
    # Each rank's loss is its own rows' mean: the ranks' losses average to the batch's.
    assert len(got["losses"]) == 5
    import json
    facts = [json.load(open("%s.rank%d.json" % (out, r))) for r in range(nproc)]
    assert [f["rank"] for f in facts] == list(range(nproc))
    assert all(f["world_size"] == nproc for f in facts)
    assert [f["local_rank"] for f in facts] == list(range(nproc))
    # One consolidated safetensors export (rank 0 wrote it; the others sent their parts):
    # every tensor whole, the same values as the gathered state dict.
    files = sorted(os.listdir(out + ".st"))
    assert files == ["model.safetensors"], files
    exported = read_safetensors(os.path.join(out + ".st", "model.safetensors"))
    assert sorted(exported) == sorted(want)
    for name, t in exported.items():
        assert torch.equal(t, got["state"][name]), name


def test_clipping_and_accumulation_across_processes(scratch):
    out = os.path.join(scratch, "out")
    torchrun(2, ["--out", out, "--steps", "4", "--gas", "2", "--clip", "0.05"])
    got = torch.load(out + ".pt")
    want, _, norms = reference(4, clip=0.05)
    for name, w in want.items():
        diff = (got["state"][name] - w).abs().max().item()
        assert diff <= 1e-5, "%s differs from torch AdamW by %g" % (name, diff)
    # The global gradient norm before clipping is the whole batch's: gradients are averaged
    # over the ranks (Adam's update is blind to a constant factor on the gradients; the norm
    # is not, so this is what catches a sum instead of a mean).
    assert len(got["grad_norms"]) == 4
    for step, (g, n) in enumerate(zip(got["grad_norms"], norms)):
        assert g is not None and abs(g - n) <= 1e-5 * n, (step, g, n)


def test_checkpoint_from_4_ranks_loads_into_2_and_1(scratch):
    """4 ranks train 3 steps and save; 2 ranks, and 1, load it and train 2 more: each ends
    within 1e-5 of torch AdamW's 5 steps (the reductions differ with the number of ranks, so
    not bit for bit; loaded into the same number of ranks it is, see the engine tests)."""
    ckpt = os.path.join(scratch, "ckpt")
    torchrun(4, ["--out", os.path.join(scratch, "first"), "--steps", "3", "--save", ckpt])
    want, _, _ = reference(5)
    for nproc in (2, 1):
        out = os.path.join(scratch, "then%d" % nproc)
        torchrun(nproc, ["--out", out, "--steps", "2", "--load", ckpt])
        got = torch.load(out + ".pt")
        for name, w in want.items():
            diff = (got["state"][name] - w).abs().max().item()
            assert diff <= 1e-5, "%d ranks: %s differs from torch AdamW by %g" % (nproc, name,
                                                                                  diff)


def test_deepspeed_tutorial_script_under_torchrun(scratch):
    """The DeepSpeed tutorial-shaped script (ds_tutorial.py, `import zinf as deepspeed`) with 2
    processes: init_distributed sets up torch.distributed (gloo), the engine joins its group
    through that group's store, each rank gets half of the 32 samples (DistributedSampler),
    checkpoints are saved and resumed by both ranks."""
    import json
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                                   "nvme_path": scratch}},
           "zinf": {"optimizer_threads": 1}}
    with open(scratch + "/ds_config.json", "w") as f:
        json.dump(cfg, f)
    script = os.path.join(HERE, "ds_tutorial.py")

    def run(*extra):
        cmd = [sys.executable, "-m", "zinf.torchrun", "--nproc_per_node", "2", "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), script, "--deepspeed",
               "--deepspeed_config", scratch + "/ds_config.json", "--save_dir",
               scratch + "/ckpt"] + list(extra)
        rc, text, _ = run_group(cmd)
        assert rc == 0, text[-6000:]
        lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        assert len(lines) == 2, text[-3000:]  # one per rank
        return lines

    for r in run("--epochs", "2"):
        # 16 samples per rank, micro-batch 8: 2 micro-steps per epoch; accumulation 2.
        assert r["steps"] == 4 and r["global_steps"] == 2, r
        assert r["last_loss"] < r["first_loss"], r
    for r in run("--epochs", "1", "--load_dir", scratch + "/ckpt"):
        assert r["start_step"] == 4 and r["global_steps"] == 3, r


def test_zinf_train_under_torchrun(scratch):
    """zinf-train started by torchrun (not --nproc): the agent holds MASTER_PORT, so zinf's
    store goes on the port after it; the 2 ranks train and rank 0 reports."""
    import json
    binary = os.path.join(os.environ.get("ZINF_BUILD_DIR", ""), "train", "zinf-train")
    if not os.access(binary, os.X_OK):
        pytest.skip("zinf-train is not built here (%s)" % binary)
    corpus = os.path.join(os.environ["ZINF_SOURCE_DIR"], "train", "data", "corpus.txt")
    port = free_port()
    cmd = [sys.executable, "-m", "zinf.torchrun", "--nproc_per_node", "2", "--master_addr",
           "127.0.0.1", "--master_port", str(port), "--no_python", binary, "--steps", "3",
           "--batch", "2", "--seq", "64", "--warmup", "1", "--json", "--data", corpus,
           "--nvme", os.path.join(scratch, "swap")]
    rc, out, err = run_group(cmd, merge=False)
    assert rc == 0, err[-4000:]
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert len(lines) == 1 and lines[0]["ranks"] == 2, out[-2000:]
    assert len(lines[0]["losses"]) == 3


def test_killed_rank_fails_the_others_fast(scratch):
    """Ranks started directly (no torchrun agent to clean up): rank 1 is SIGKILLed before a
    step drawn at random (1-4); ranks 0 and 2 exit non-zero, saying which rank is gone."""
    port = free_port()
    procs = []
    # A point of the run drawn per run (printed, so that a failure can be replayed).
    import random
    kill_at = random.Random().randint(1, 4)
    print("rank 1 is killed before step %d" % kill_at)
    start = time.time()
    for r in range(3):
        e = env()
        e.update({"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r),
                  "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        procs.append(subprocess.Popen(
            [sys.executable, WORKER, "--out", os.path.join(scratch, "out"), "--kill-at",
             str(kill_at), "--timeout", "60"],
            env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = {}
    try:
        for r, p in enumerate(procs):
            outputs[r] = p.communicate(timeout=120)[0].decode(errors="replace")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[1].returncode == -signal.SIGKILL
    for r in (0, 2):
        assert procs[r].returncode not in (0, None), outputs[r][-3000:]
        assert "Rank 1 (pid" in outputs[r] or "1 (pid" in outputs[r], outputs[r][-3000:]
        assert "no longer running" in outputs[r], outputs[r][-3000:]
    assert time.time() - start < 90  # interpreter start-up included; the failure itself is fast


def _start_rank(r, world, port, scratch, extra_env=None, args=()):
    e = env()
    e.update({"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
              "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port)})
    e.update(extra_env or {})
    return subprocess.Popen(
        [sys.executable, WORKER, "--out", os.path.join(scratch, "out%d-%s" % (r, port)),
         "--timeout", "300", "--steps", "2"] + list(args),
        env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(p, timeout=120):
    try:
        return p.communicate(timeout=timeout)[0].decode(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_two_jobs_on_one_port_never_pair(scratch):
    """Job B's rank 1 reaches job A's store before A's own rank 1: before, it waited there
    (or, without job ids, paired with A's rank 0); now it fails at once naming the other job,
    and job A trains."""
    port = free_port()
    a0 = _start_rank(0, 2, port, scratch, {"ZINF_JOB_ID": "job-a"})
    try:
        start = time.time()
        b1 = _start_rank(1, 2, port, scratch, {"ZINF_JOB_ID": "job-b"})
        out_b = _finish(b1)
        assert b1.returncode not in (0, None), out_b[-3000:]
        assert "belongs to another job" in out_b, out_b[-3000:]
        assert time.time() - start < 150, out_b[-3000:]  # not the 300 s collective timeout
        a1 = _start_rank(1, 2, port, scratch, {"ZINF_JOB_ID": "job-a"})
        out_a1 = _finish(a1)
        assert a1.returncode == 0, out_a1[-3000:]
    finally:
        out_a0 = _finish(a0)
    assert a0.returncode == 0, out_a0[-3000:]


def test_ranks_with_another_setting_are_refused_naming_it(scratch):
    """Rank 1 with another gradient clipping: before, both waited for the collective timeout
    and blamed "different collectives"; now both fail at once naming the setting."""
    port = free_port()
    start = time.time()
    procs = [_start_rank(0, 2, port, scratch),
             _start_rank(1, 2, port, scratch, args=("--clip", "1.0"))]
    outs = [_finish(p) for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode not in (0, None), outs[r][-3000:]
        assert "the ranks disagree on the model and its training settings" in outs[r], \
            outs[r][-3000:]
        assert "gradient_clipping: rank 0 has 0, rank 1 has 1" in outs[r], outs[r][-3000:]
    assert time.time() - start < 150  # interpreter start-up included; not the 300 s timeout


@pytest.mark.parametrize("how,names", [
    ("fill-rank", "the ranks disagree on the parameter values being set: the values set for "
                  "'0.weight'"),
    ("fill-rank0", "next: rank 0 has write parameter '0.weight' (fill_), rank 1 has a forward"),
    ("load-rank0", "next: rank 0 has model.load_state_dict, rank 1 has a forward"),
    ("read-rank0", "next: rank 0 has read parameter '0.weight' outside a forward, rank 1 has "
                   "a forward"),
])
def test_writes_and_reads_on_some_ranks_only_are_refused_on_every_rank(scratch, how, names):
    """Before: fill_(rank + 1) left the weight half 1, half 2 (exit 0); a write on rank 0 only
    waited for the collective timeout; load_state_dict on rank 0 only aborted rank 0 inside
    gloo (SIGABRT). Now every rank fails at once, naming what each did."""
    port = free_port()
    start = time.time()
    procs = [_start_rank(r, 2, port, scratch, args=("--diverge", how, "--steps", "3"))
             for r in range(2)]
    outs = [_finish(p) for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 1, (r, p.returncode, outs[r][-3000:])  # an error, not a signal
        assert names in outs[r], (r, outs[r][-3000:])
    assert time.time() - start < 150  # not the 300 s collective timeout


def test_a_window_of_another_shape_on_one_rank_is_refused_on_every_rank(scratch):
    """engine.train_window with one micro-batch more on rank 0: the ranks compare the window's
    shape before anything else, so both fail at once naming both (before, rank 0 raised alone
    and rank 1 was left in the window's first comparison)."""
    port = free_port()
    start = time.time()
    procs = [_start_rank(r, 2, port, scratch,
                         args=("--layer-major", "--gas", "2", "--diverge", "window-rank0",
                               "--steps", "3")) for r in range(2)]
    outs = [_finish(p) for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 1, (r, p.returncode, outs[r][-3000:])
        assert "rank 0 has engine.train_window of 3 micro-batches through 3 blocks, rank 1 " \
               "has engine.train_window of 2 micro-batches" in outs[r], (r, outs[r][-3000:])
    assert time.time() - start < 150  # not the 300 s collective timeout
