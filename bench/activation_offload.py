#!/usr/bin/env python3
"""Activation checkpointing with offload, measured: a Llama-style model (zinf.models.Llama)
trained a few steps with zinf on the host device, once per mode, each in its own process:

    none     no checkpointing: autograd keeps every activation
    memory   zinf.checkpoint around each layer, the boundary activations kept where they are
    cpu      the same with activation_checkpointing.cpu_checkpointing
    nvme     the same with activation_checkpointing.nvme_checkpointing (--nvme folder)

For each mode: the peak RSS growth over the training steps (VmHWM reset once the engine has
its stores and pinned arena, minus the RSS then: what the steps' activations add), the median
step time over the steps after the first, every step's loss and
the offload figures (bytes written and read, reads that were prefetched). One JSON line per
mode and round (--rounds R runs every mode R times, the order rotated), then a summary line
with each mode's median over the rounds, the ratios against "memory", and whether the losses
are identical (across the checkpointed modes and rounds they must be: the same arithmetic in
the same order; against "none" too, on this CPU).

    PYTHONPATH=build/python python3 bench/activation_offload.py --layers 24 --seq 2048 \\
        --dim 256 --steps 4 --nvme /var/tmp

--interleave measures step time alone, every mode in one process: each round runs one step
per mode (order rotated) and the ratio against "memory" is taken within the round (a busy
machine then slows every mode alike); the median of those paired ratios is reported, for the
wall time and for the process's CPU time (every thread's; what other processes on a shared
machine disturb least, though it does not see time spent waiting for the disk).

On the host device, device memory is host memory: cpu_checkpointing has nothing to move (the
boundary tensors stay where they are), so its cost is only the bookkeeping; nvme is the mode
that takes the boundaries out of the process.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("none", "memory", "cpu", "nvme")


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def run_mode(a):
    import torch
    import torch.nn.functional as F

    import zinf
    from zinf.models import Llama

    torch.set_num_threads(a.threads)

    class Checkpointed(Llama):
        mode = a.mode

        def forward(self, ids, targets=None):
            x = self.embed_tokens(ids)
            for layer in self.layers:
                x = zinf.checkpoint(layer, x) if self.mode != "none" else layer(x)
            logits = self.lm_head(self.norm(x))
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]),
                                   targets.reshape(-1))

    torch.manual_seed(0)
    model = Checkpointed(vocab=256, dim=a.dim, layers=a.layers, n_heads=a.heads,
                         n_kv_heads=a.heads // 2, hidden=a.dim * 8 // 3 // 8 * 8,
                         max_seq=a.seq)
    params = sum(p.numel() for p in model.parameters())
    cfg = {
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zinf": {"optimizer_threads": 1},
    }
    if a.mode in ("cpu", "nvme"):
        cfg["activation_checkpointing"] = {"cpu_checkpointing": a.mode == "cpu",
                                           "nvme_checkpointing": a.mode == "nvme",
                                           "nvme_path": a.nvme, "buffer_bytes": a.buffer}
    engine = zinf.initialize(model, cfg, device="cpu")
    engine._ensure_registered()  # the stores and the pinned arena exist before the baseline
    if a.mode == "interleave":
        return interleave(a, engine, model)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (a.batch, a.seq + 1), generator=g) for _ in range(a.steps)]
    baseline = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    times, losses = [], []
    for tokens in batches:
        t0 = time.perf_counter()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = status("VmHWM")
    store = zinf._activations.current_store()
    out = {"mode": a.mode, "layers": a.layers, "seq": a.seq, "dim": a.dim, "batch": a.batch,
           "params": params, "steps": a.steps, "threads": a.threads,
           "peak_rss_growth_mib": round((peak - baseline) / 2**20, 1),
           "baseline_rss_mib": round(baseline / 2**20, 1),
           "step_seconds": round(statistics.median(times[1:] or times), 3),
           "step_seconds_all": [round(t, 3) for t in times], "losses": losses}
    if store is not None:
        out.update({k: v for k, v in store.stats.items()})
        out["buffer_bytes"] = a.buffer
    print(json.dumps(out), flush=True)


def interleave(a, engine, model):
    """Step time only, every mode in one process: each round runs one step per mode (the order
    rotated), so that load from other processes falls on every mode alike; the ratio against
    "memory" is taken within each round, then the median over the rounds."""
    import torch

    from zinf import _activations

    modes = [m for m in a.modes.split(",")]
    blocks = {"memory": {}, "none": {}, "cpu": {"cpu_checkpointing": True},
              "nvme": {"nvme_checkpointing": True, "nvme_path": a.nvme,
                       "buffer_bytes": a.buffer}}
    # One store per mode, made once (the NVMe one opens its swap files at its first step).
    stores = {m: _activations.configure(_activations.Settings.from_config(blocks[m], []),
                                        engine) for m in modes}
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (a.batch, a.seq + 1), generator=g)
    times = {m: [] for m in modes}
    cpu = {m: [] for m in modes}
    for r in range(a.rounds + 1):  # round 0 warms every mode up
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            _activations._store = stores[mode]  # the bench switches stores between steps
            model.mode = mode
            t0, c0 = time.perf_counter(), time.process_time()
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            engine.step()
            if r > 0:
                times[mode].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)
    out = {"interleaved": True, "rounds": a.rounds, "layers": a.layers, "seq": a.seq,
           "dim": a.dim, "threads": a.threads}
    for m in modes:
        out[m + "_step_seconds"] = round(statistics.median(times[m]), 3)
        out[m + "_cpu_seconds"] = round(statistics.median(cpu[m]), 3)
        if "memory" in times:
            out[m + "_paired_vs_memory"] = round(statistics.median(
                t / b for t, b in zip(times[m], times["memory"])), 3)
            out[m + "_cpu_paired_vs_memory"] = round(statistics.median(
                t / b for t, b in zip(cpu[m], cpu["memory"])), 3)
        out[m + "_all"] = [round(t, 3) for t in times[m]]
        out[m + "_cpu_all"] = [round(t, 3) for t in cpu[m]]
    print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--nvme", default="/var/tmp", help="folder for the nvme mode")
    ap.add_argument("--buffer", default="64M", help="activation_checkpointing.buffer_bytes")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=1, help="runs of every mode (order rotated)")
    ap.add_argument("--interleave", action="store_true",
                    help="step times of every mode in one process, rounds of one step each")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.interleave:
        a.mode = "interleave"
        return run_mode(a)
    if a.mode:
        return run_mode(a)
    modes = a.modes.split(",")
    results = {m: [] for m in modes}
    for r in range(a.rounds):
        # The order rotates from round to round, so that no mode always runs first or last.
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            work = tempfile.mkdtemp(prefix="zinf-actbench-", dir=a.nvme)
            cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--nvme", work]
            for k in ("layers", "seq", "dim", "heads", "batch", "steps", "threads", "buffer"):
                cmd += ["--" + k, str(getattr(a, k))]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            shutil.rmtree(work, ignore_errors=True)
            if proc.returncode != 0:
                raise SystemExit("mode %s failed (exit %d)" % (mode, proc.returncode))
            line = json.loads(proc.stdout.strip().splitlines()[-1])
            line["round"] = r
            print(json.dumps(line), flush=True)
            results[mode].append(line)
    med = {m: {"step_seconds": statistics.median(x["step_seconds"] for x in rs),
               "peak_rss_growth_mib": statistics.median(x["peak_rss_growth_mib"] for x in rs)}
           for m, rs in results.items()}
    summary = {"summary": True, "rounds": a.rounds}
    for mode in modes:
        summary[mode + "_step_seconds"] = round(med[mode]["step_seconds"], 3)
        summary[mode + "_rss_growth_mib"] = med[mode]["peak_rss_growth_mib"]
        if "memory" in med:
            summary[mode + "_time_vs_memory"] = round(
                med[mode]["step_seconds"] / med["memory"]["step_seconds"], 3)
    ckpt = [rs[0]["losses"] for m, rs in results.items() if m != "none"]
    summary["checkpointed_losses_identical"] = all(l == ckpt[0] for l in ckpt) and all(
        x["losses"] == rs[0]["losses"] for rs in results.values() for x in rs)
    if "none" in results and ckpt:
        summary["none_losses_identical"] = results["none"][0]["losses"] == ckpt[0]
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
