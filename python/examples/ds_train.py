"""A training script written for DeepSpeed, nothing in it about zinf; run it on zinf with

    python3 -m zinf.launch [--nproc_per_node N] python/examples/ds_train.py \
        --deepspeed_config ds_config.json [--steps 6] [--save_dir CKPT --save_at 3]
        [--load_dir CKPT --tag step3] [--out final.pt]

It uses what DeepSpeed's examples and DeepSpeed-Chat use: deepspeed.init_distributed, the model
built under deepspeed.zero.Init, parameter groups (weight decay on weights, none on biases and
norms, the head at its own learning rate) split by moe.utils into a DeepSpeedCPUAdam, a torch
LambdaLR scheduler, a head bias set on rank 0 inside GatheredParameters(modifier_rank=0),
accelerator and comm queries, tagged checkpoints with client_state, and the batch sizes from
the config (any two of train_batch_size, train_micro_batch_size_per_gpu and
gradient_accumulation_steps). Each rank trains on its own rows of a synthetic classification
set (a pure function of step, micro-step and rank). Rank 0 prints one JSON line per run and,
with --out, saves the fp32 weights (deepspeed.utils.safe_get_full_fp32_param).
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.utils import safe_get_full_fp32_param


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.norm = nn.LayerNorm(64)
        self.fc2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(F.gelu(self.fc2(self.norm(F.gelu(self.fc1(x))))))


def build_model():
    torch.manual_seed(0)
    return Net()


def optimizer_groups(model, weight_decay=0.1, head_lr=2e-2):
    """Hugging Face's two groups and DeepSpeed-Chat's own-learning-rate group."""
    decay, no_decay, head = [], [], []
    for name, p in model.named_parameters():
        if name.startswith("head."):
            head.append(p)
        elif p.dim() < 2 or "norm" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": head, "weight_decay": 0.0, "lr": head_lr}]


def schedule(step):
    return 1.0 / (1.0 + 0.2 * step)


def rows(step, micro, rank, size):
    """Rank `rank`'s rows of micro-step `micro` of optimizer step `step`."""
    g = torch.Generator().manual_seed(100003 * step + 1009 * micro + rank)
    centers = torch.arange(4 * 16, dtype=torch.float32).reshape(4, 16).sin() * 3
    y = torch.randint(0, 4, (size,), generator=g)
    return centers[y] + torch.randn(size, 16, generator=g), y


def main():
    parser = argparse.ArgumentParser(description="DeepSpeed-style training")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--save_dir", default=None)
    parser.add_argument("--save_at", type=int, default=-1)
    parser.add_argument("--load_dir", default=None)
    parser.add_argument("--tag", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    rank = deepspeed.comm.get_rank()
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
        model = build_model()
    groups = split_params_into_different_moe_groups_for_optimizer(optimizer_groups(model))
    optimizer = DeepSpeedCPUAdam(groups, lr=args.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    # A value head starts at a chosen value, set on one rank and seen by every rank.
    with deepspeed.zero.GatheredParameters(model.head.bias, modifier_rank=0):
        if rank == 0:
            model.head.bias.data.fill_(0.25)

    start = 0
    if args.load_dir is not None:
        _, client = engine.load_checkpoint(args.load_dir, tag=args.tag)
        start = client["step"]
    losses = []
    for step in range(start, args.steps):
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = rows(step, micro, rank, engine.train_micro_batch_size_per_gpu())
            x, y = x.to(engine.device), y.to(engine.device)
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if args.save_dir is not None and step + 1 == args.save_at:
            engine.save_checkpoint(args.save_dir, tag="step%d" % (step + 1),
                                   client_state={"step": step + 1})
    weights = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    if rank == 0:
        if args.out is not None:
            torch.save(weights, args.out)
        accel = get_accelerator()
        print(json.dumps({
            "deepspeed": deepspeed.__version__, "zinf": getattr(deepspeed, "__zinf__", None),
            "world": deepspeed.comm.get_world_size(), "device": accel.device_name(),
            "memory_allocated": accel.memory_allocated(),
            "batch": [engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                      engine.gradient_accumulation_steps()],
            "global_steps": engine.global_steps, "lr": [g["lr"] for g in optimizer.param_groups],
            "losses": losses}), flush=True)


if __name__ == "__main__":
    main()
