"""One rank of a multi-process test (test_multiprocess.py), started by torchrun or by the test
itself with the launcher's variables set.

Trains a small MLP with zinf on this rank's rows of a fixed global batch, then writes (rank 0)
the full state dict, the losses and the engine's rank facts to --out. --kill-at N: rank 1 kills
itself with SIGKILL before step N (the others must fail, not hang).
"""
import argparse
import json
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import zinf  # noqa: E402
from conftest import make_config  # noqa: E402


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    x = torch.randn(16, 12)
    y = torch.randn(16, 4)
    return model, x, y


def diverge(engine, model, rank, how):
    w = model[0].weight
    if how == "fill-rank":
        with torch.no_grad():
            w.fill_(rank + 1)
    elif how == "fill-rank0" and rank == 0:
        with torch.no_grad():
            w.fill_(1.0)
    elif how == "load-rank0" and rank == 0:
        fresh, _, _ = model_and_data(seed=3)
        model.load_state_dict(fresh.state_dict())
    elif how == "read-rank0" and rank == 0:
        print("rank 0 reads", float(w.sum()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--states", default="cpu")
    ap.add_argument("--param", default="cpu")
    ap.add_argument("--nvme", default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gas", type=int, default=1)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--save", default=None)
    ap.add_argument("--load", default=None)
    ap.add_argument("--out", required=True)
    # After step 1, before the next forward: "fill-rank" fills a weight with rank + 1 on
    # every rank; "fill-rank0" fills it on rank 0 only; "load-rank0" loads a state dict on
    # rank 0 only; "read-rank0" reads a weight on rank 0 only (issue 38's hostile cases).
    ap.add_argument("--diverge", default="")
    # zinf.schedule layer-major: each step one engine.train_window over the MLP as a stack
    # (--diverge window-rank0: rank 0 passes one micro-batch more at step 1).
    ap.add_argument("--layer-major", action="store_true")
    args = ap.parse_args()
    model, x, y = model_and_data()
    cfg = make_config(param=args.param, states=args.states, nvme=args.nvme, lr=1e-2,
                      gas=args.gas, clip=args.clip,
                      collective_timeout_seconds=args.timeout)
    if args.layer_major:
        cfg["zinf"]["schedule"] = "layer-major"
    if torch.cuda.is_available():
        cfg["zinf"]["device_budget_bytes"] = "256M"
    engine = zinf.initialize(model, cfg)
    rank, world = engine.rank, engine.world_size
    x, y = x.to(engine.device), y.to(engine.device)
    if args.load:
        engine.load_checkpoint(args.load)
    rows = x.shape[0] // (world * args.gas)
    losses, grad_norms = [], []
    for step in range(args.steps):
        if step == 1 and args.diverge and not args.layer_major:
            diverge(engine, model, rank, args.diverge)
        if step == args.kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        total = 0.0
        if args.layer_major:
            mbs = [(x[(m * world + rank) * rows:][:rows], y[(m * world + rank) * rows:][:rows])
                   for m in range(args.gas)]
            if step == 1 and args.diverge == "window-rank0" and rank == 0:
                mbs.append(mbs[0])

            def head(h, t):
                return torch.nn.functional.mse_loss(model[4](h), t)

            blocks = [model[1], model[2], model[3]]
            total = sum(l.item() for l in engine.train_window(mbs, model[0], blocks, head))
            stats = engine.step()
            losses.append(total)
            grad_norms.append(None)
            continue
        for m in range(args.gas):
            begin = (m * world + rank) * rows
            loss = torch.nn.functional.mse_loss(engine(x[begin:begin + rows]),
                                                y[begin:begin + rows])
            engine.backward(loss)
            stats = engine.step()
            total += loss.item()
        losses.append(total)
        grad_norms.append(stats.get("grad_norm") if isinstance(stats, dict) else None)
    if args.save:
        engine.save_checkpoint(args.save)
    state = engine.full_state_dict()  # every rank: the gather is a collective
    zinf.save_safetensors(engine, args.out + ".st")  # rank 0 writes
    if rank == 0:
        torch.save({"state": state, "losses": losses, "grad_norms": grad_norms}, args.out + ".pt")
    with open("%s.rank%d.json" % (args.out, rank), "w") as f:
        json.dump({"rank": rank, "world_size": world, "local_rank": engine.local_rank,
                   "pid": os.getpid()}, f)


if __name__ == "__main__":
    main()
