"""A training script in the shape of DeepSpeed's getting-started tutorial, with
`import zinf as deepspeed` as its only change (for test_deepspeed.py).

    ds_tutorial.py --deepspeed --deepspeed_config ds_config.json --save_dir CKPT
                   [--load_dir CKPT] [--epochs N]

It trains a small classifier on a fixed synthetic dataset, saves a checkpoint after every
epoch with the step in client_state, resumes from --load_dir when given, and prints one JSON
line: the first and last loss, the micro-steps run, the step it started from, the engine's
global_steps and learning rate.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import zinf as deepspeed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 4)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Blobs(torch.utils.data.Dataset):
    """Four Gaussian blobs in 16 dimensions: a learnable classification."""

    def __init__(self, n=32):
        g = torch.Generator().manual_seed(0)
        self.labels = torch.randint(0, 4, (n,), generator=g)
        centers = torch.randn(4, 16, generator=g) * 3
        self.x = centers[self.labels] + torch.randn(n, 16, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.x[i], self.labels[i]


def add_argument():
    parser = argparse.ArgumentParser(description="tutorial")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save_dir", required=True)
    parser.add_argument("--load_dir", default=None)
    parser.add_argument("--ckpt_id", default=None)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    deepspeed.init_distributed()
    cmd_args = add_argument()
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=cmd_args, model=net, model_parameters=parameters, training_data=Blobs())

    step = 0
    if cmd_args.load_dir is not None:
        _, client_sd = model_engine.load_checkpoint(cmd_args.load_dir, cmd_args.ckpt_id)
        step = client_sd["step"]
    start = step
    torch.manual_seed(1 + step)  # the shuffles of a resumed run differ from the first run's
    losses = []
    for epoch in range(cmd_args.epochs):
        for data in trainloader:
            inputs = data[0].to(model_engine.device)
            labels = data[1].to(model_engine.device)
            outputs = model_engine(inputs)
            loss = F.cross_entropy(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            step += 1
        model_engine.save_checkpoint(cmd_args.save_dir, client_state={"step": step})
    line = json.dumps({"first_loss": losses[0], "last_loss": losses[-1], "steps": len(losses),
                       "start_step": start, "global_steps": model_engine.global_steps,
                       "lr": model_engine.get_lr()[0]})
    # Both ranks share the launcher's stdout: one write(2) per line (a pipe keeps writes under
    # PIPE_BUF whole), or a buffer flushed mid-line interleaves the two ranks' lines.
    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


if __name__ == "__main__":
    main()
