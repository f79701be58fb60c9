#!/usr/bin/python3
"""What the ranks' comparison before each forward and step costs (issue 38): two rank
processes train the same small Llama-style model from Python, alternating legs with the
comparison on (as shipped) and off (engine._between_steps replaced by a no-op on every rank),
in one run, same files; prints one JSON line with the median step time of each and their ratio.

  /usr/bin/python3 bench/rank_sync_cost.py [--steps 30] [--rounds 4]

Run it from the repository with the package built (scripts/build.sh); it starts its own two
ranks on a free loopback port.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def rank_main(args):
    sys.path.insert(0, os.path.join(ROOT, "python", "tests"))
    import torch
    import zinf
    from conftest import make_config
    from models import Llama, batch
    torch.manual_seed(0)
    engine = zinf.initialize(Llama(), make_config(lr=1e-3))
    shipped = engine._between_steps
    legs = {"on": [], "off": []}
    ids, tgt = batch(0)
    for r in range(args.rounds):
        for leg in (("on", "off") if r % 2 == 0 else ("off", "on")):
            engine._between_steps = shipped if leg == "on" else (lambda action: None)
            for s in range(args.steps):
                t0 = time.perf_counter()
                engine.backward(engine(ids, tgt))
                engine.step()
                legs[leg].append(time.perf_counter() - t0)
    engine._between_steps = shipped
    if engine.rank == 0:
        on, off = statistics.median(legs["on"]), statistics.median(legs["off"])
        print(json.dumps({"bench": "rank_sync_cost", "ranks": engine.world_size,
                          "steps_per_leg": args.steps * args.rounds // 2,
                          "median_step_s_on": round(on, 6), "median_step_s_off": round(off, 6),
                          "ratio_on_over_off": round(on / off, 4)}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="steps per leg and round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds (legs alternate in order)")
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank >= 0:
        return rank_main(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1",
                   PYTHONPATH=os.path.join(ROOT, "build", "python") + os.pathsep +
                   os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--steps",
                                       str(args.steps), "--rounds", str(args.rounds)], env=env))
    rc = [p.wait(timeout=1800) for p in procs]
    return 0 if rc == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
