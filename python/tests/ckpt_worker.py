"""Trains the test Llama with zinf in its own process, for the kill-and-resume tests.

    ckpt_worker.py fresh|resume|durable-fresh|durable-resume WORK STEPS OUT

fresh/resume: parameters and states on NVMe in WORK/swap, a checkpoint after every optimizer
step in WORK/ckpt (resume: from the newest one; none yet means from the start).
durable-*: zinf.durable instead of checkpoints (resume: engine.resume_from_store()).
Accumulation 2, clipping and a learning-rate schedule, one torch thread (bit-reproducible).
At the end the full state dict goes to OUT. ZINF_CRASH_AT (the engine's crash points) or
ZINF_TEST_KILL_AT=<step> (SIGKILL after that step's first forward) kill it on the way.
"""
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zinf  # noqa: E402
from conftest import make_config  # noqa: E402
from models import Llama, batch  # noqa: E402


class CountingLlama(Llama):
    """Llama with a persistent buffer the training changes (checkpoints must keep it)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, ids, targets=None):
        if self.training:
            with torch.no_grad():
                self.seen += ids.shape[0]
        return super().forward(ids, targets)


def main():
    mode, work, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    torch.manual_seed(5)
    model = CountingLlama()
    durable = mode.startswith("durable")
    os.makedirs(work + "/swap", exist_ok=True)
    cfg = make_config("nvme", "nvme", nvme=work + "/swap", lr=3e-3, gas=2, clip=1.0,
                      durable=durable)
    engine = zinf.initialize(model, cfg, device="cpu")
    start = 0
    if mode == "resume":
        try:
            start = engine.load_checkpoint(work + "/ckpt")["step"]
        except zinf.ZinfError as e:
            if e.code != "NotFound":
                raise
    elif mode == "durable-resume":
        try:
            engine.resume_from_store()
        except zinf.ZinfError as e:
            if e.code != "NotFound":
                raise
        start = engine.global_step
    kill_at = int(os.environ.get("ZINF_TEST_KILL_AT", "-1"))
    for step in range(start, steps):
        engine.set_lr(3e-3 * min(1.0, (step + 1) / 3))
        for micro in range(2):
            ids, tgt = batch(step, micro)
            loss = engine(ids, tgt)
            if step == kill_at and micro == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            engine.backward(loss)
            engine.step()
        if not durable:
            engine.save_checkpoint(work + "/ckpt", {"step": step + 1})
    state = engine.full_state_dict()
    state["seen"] = model.seen.clone()
    torch.save(state, out)


if __name__ == "__main__":
    main()
