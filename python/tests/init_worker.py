"""Builds a Llama under zinf.Init, loads a sharded safetensors checkpoint into it and exports
it again, measuring the process's peak RSS from just before the model is built (for
test_init_safetensors.py). Prints one JSON line.

    init_worker.py CKPT_DIR WORK_DIR
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zinf  # noqa: E402
from models import Llama  # noqa: E402
from st_writer import read_file  # noqa: E402

SHAPE = dict(vocab=4096, dim=768, layers=8, n_heads=12, n_kv_heads=4, hidden=2048, max_seq=32)


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def config(nvme):
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 3},
            "sub_group_size": 2000000,
            "stage3_prefetch_bucket_size": 2000000,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zinf": {"pinned_budget_bytes": "192M", "optimizer_threads": 1},
    }


def main():
    ckpt, work = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    os.makedirs(work + "/swap", exist_ok=True)
    baseline = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")
    cfg = config(work + "/swap")
    with zinf.Init(cfg) as init:
        model = Llama(**SHAPE)
    engine = zinf.initialize(model, cfg, device="cpu")
    report = zinf.load_safetensors(engine, ckpt)
    peak = status("VmHWM")
    # Loaded values equal the file's, converted exactly to fp32.
    files = {}
    for name in os.listdir(ckpt):
        if name.endswith(".safetensors"):
            files.update(read_file(os.path.join(ckpt, name)))
    numel = 0
    largest = 0
    for name, param in model.named_parameters():
        got = engine.gather(param)
        assert torch.equal(got, files[name].float()), name
        numel += param.numel()
        largest = max(largest, param.numel())
    # Round trip: export (sharded) and compare with the masters, bit for bit.
    zinf.save_safetensors(engine, work + "/export", shard_size="40M")
    exported = {}
    for name in os.listdir(work + "/export"):
        if name.endswith(".safetensors"):
            exported.update(read_file(os.path.join(work + "/export", name)))
    assert set(exported) == {n for n, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        assert torch.equal(exported[name], engine.gather(param)), name
    print(json.dumps({"baseline_rss": baseline, "peak_rss": peak, "params": numel,
                      "largest": largest, "spilled": init.parameters,
                      "loaded": len(report["loaded"]),
                      "shards": len([n for n in os.listdir(work + "/export")
                                     if n.endswith(".safetensors")])}))


if __name__ == "__main__":
    main()
