#!/usr/bin/python3
"""Which 8-bit map and block size for Adam's moments (issue 17): a measurement, not a test.

Trains one small model with torch's AdamW math written out, once with fp32 moments and once
per candidate storage of the moments: each step dequantises the moments, updates them in fp32,
steps the parameters with the fp32 values, and stores the moments quantised again (what the
CPU kernels do). Prints the final loss of each and its ratio to fp32.

The model is chosen to stress the second moment's dynamic range: a bag-of-words classifier
whose tokens follow a Zipf law, so an embedding block holds rows that get gradients every step
next to rows that get one in a thousand steps (second moments 1e6 apart).

Candidates:
  linear      absmax-scaled int8 (the map known to fail on the second moment)
  tree        a dynamic map in the style of Dettmers et al.'s dynamic tree (decades, a linear
              fraction whose width grows as the exponent shrinks)
  e4m3/e4m4   a small float: a sign (first moment only), exponent and mantissa bits, scaled so
              that the block's absmax is the largest code; "nz": a non-zero second moment never
              rounds to zero (it takes the smallest code), "sqrt": the code stores sqrt(v)
  bf16        round to nearest even

Usage: bench/state_quant_study.py [--steps 1500] [--seeds 3]
"""
import argparse
import math

import torch


def small_float_grid(exp_bits, man_bits):
    """Non-negative values of a float with exp_bits/man_bits (subnormals, no inf/NaN)."""
    vals = []
    for e in range(2 ** exp_bits):
        for f in range(2 ** man_bits):
            if e == 0:
                vals.append(f / 2 ** man_bits * 2.0 ** (1 - 2 ** exp_bits))
            else:
                vals.append((1 + f / 2 ** man_bits) * 2.0 ** (e - 2 ** exp_bits))
    g = torch.tensor(vals, dtype=torch.float64)
    return g / g.max()


def tree_grid(bits):
    """Decades 10^-k with a linear fraction in (0.1, 1] of 2^(bits-1-k) steps, plus zero."""
    vals = [0.0]
    for k in range(bits):
        n = 2 ** (bits - 1 - k)
        for j in range(n):
            vals.append(10.0 ** (-k) * (0.1 + 0.9 * (j + 1) / n))
    g = torch.tensor(sorted(set(vals)), dtype=torch.float64)
    return g / g.max()


def nearest(grid, y):
    """Nearest grid value to each y in [0, 1] (grid sorted ascending)."""
    mids = (grid[1:] + grid[:-1]) / 2
    idx = torch.searchsorted(mids, y.double())
    return grid[idx]


class Store:
    def __init__(self, kind, block):
        self.kind, self.block = kind, block
        self.grids = {}
        if kind == "linear":
            self.grids = {True: torch.linspace(0, 1, 128, dtype=torch.float64),
                          False: torch.linspace(0, 1, 256, dtype=torch.float64)}
        elif kind == "tree":
            self.grids = {True: tree_grid(7), False: tree_grid(8)}
        elif kind.startswith("e4m"):
            self.grids = {True: small_float_grid(4, 3), False: small_float_grid(4, 4)}

    def __call__(self, x, signed):
        if self.kind == "fp32":
            return x
        if self.kind == "bf16":
            return x.to(torch.bfloat16).float()
        nonzero_floor = (not signed) and "nz" in self.kind
        use_sqrt = (not signed) and "sqrt" in self.kind
        flat = x.flatten()
        if use_sqrt:
            flat = flat.sqrt()
        pad = (-flat.numel()) % self.block
        blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, self.block)
        absmax = blocks.abs().max(dim=1, keepdim=True).values
        scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        grid = self.grids[signed]
        y = (blocks.abs() / scale).clamp(max=1.0)
        q = nearest(grid, y)
        if nonzero_floor:
            q = torch.where((y > 0) & (q == 0), grid[1].expand_as(q), q)
        out = (torch.sign(blocks) * q * scale).float().flatten()[: flat.numel()]
        if use_sqrt:
            out = out * out
        return out.view_as(x)


def make_data(seed, n_tokens=4000, n_classes=16, seq=24, n=20000):
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, n_tokens + 1, dtype=torch.float64)
    p = (1.0 / ranks ** 1.1)
    p /= p.sum()
    toks = torch.multinomial(p, n * seq, replacement=True, generator=g).view(n, seq)
    w = torch.randn(n_tokens, n_classes, generator=g)
    labels = w[toks].sum(1).argmax(1)
    return toks, labels


def train(store, seed, steps, lr=2e-3, batch=128):
    toks, labels = make_data(seed)
    torch.manual_seed(seed)
    emb = torch.nn.Embedding(4000, 64)
    l1 = torch.nn.Linear(64, 128)
    l2 = torch.nn.Linear(128, 16)
    params = list(emb.parameters()) + list(l1.parameters()) + list(l2.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01
    g = torch.Generator().manual_seed(seed + 1)
    losses = []
    for step in range(1, steps + 1):
        idx = torch.randint(0, toks.shape[0], (batch,), generator=g)
        h = emb(toks[idx]).mean(1)
        logits = l2(torch.relu(l1(h)))
        loss = torch.nn.functional.cross_entropy(logits, labels[idx])
        for p in params:
            p.grad = None
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            bc1 = 1 - b1 ** step
            bc2 = 1 - b2 ** step
            for i, p in enumerate(params):
                mi = m[i] + (1 - b1) * (p.grad - m[i])
                vi = b2 * v[i] + (1 - b2) * p.grad * p.grad
                p.mul_(1 - lr * wd)
                p.add_(-lr / bc1 * mi / (vi.sqrt() / math.sqrt(bc2) + eps))
                m[i] = store(mi, True)
                v[i] = store(vi, False)
    tail = losses[-100:]
    return sum(tail) / len(tail)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    cases = [("fp32", 0), ("bf16", 0)]
    for block in (64, 256, 2048):
        for kind in ("linear", "tree", "e4m", "e4m-nz", "e4m-nz-sqrt"):
            cases.append((kind, block))
    base = None
    print(f"{'storage':<14}{'block':>6}{'loss (mean of last 100 steps, per seed)':>44}{'ratio':>9}")
    for kind, block in cases:
        losses = [train(Store(kind, block), s, args.steps) for s in range(args.seeds)]
        mean = sum(losses) / len(losses)
        if base is None:
            base = mean
        print(f"{kind:<14}{block:>6}{' '.join(f'{x:.4f}' for x in losses):>44}{mean / base:>9.3f}",
              flush=True)


if __name__ == "__main__":
    main()
