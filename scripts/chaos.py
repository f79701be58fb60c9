#!/usr/bin/python3
"""zinf's fault campaign: hurts zinf-train in seeded random ways and checks what survives.

Every case trains the tiny model (parameters and optimizer states on NVMe) for a few steps,
with checkpoints every step or with the durable swap store, hurts it, resumes it, and
classifies the outcome against an uninterrupted run of the same command:

  identical     the run (after its resume) ends on the uninterrupted run's parameters, bit
                for bit (param_checksum);
  clear-error   zinf-train refused or stopped with exit 1 or 2 and one "zinf-train: ..." line
                naming the problem, and nothing that was intact before was changed or removed;
  silent-wrong  it finished (exit 0) on other parameters;
  data-loss     something intact before (a checkpoint, a committed store) was changed or
                removed by a failed run, or a recoverable state could not be resumed;
  crash         anything else: killed by a signal it was not sent, an exit code other than
                0/1/2, no message, or a hang (past --timeout).

The faults (the `kind` column):
  kill-time     SIGKILL at a random time, then --resume;
  kill-point    SIGKILL at a named point (ZINF_CRASH_AT: inside a swap write, between
                optimizer sub-groups, in the backward, at each stage of a checkpoint or a
                durable commit), then --resume;
  flip          after a kill, one byte of a random file (swap file, swap index, checkpoint
                piece, manifest, latest) XORed with a random value, then --resume;
  truncate      after a kill, a random file cut to a random length, then --resume;
  remove        after a kill, a random file removed, then --resume;
  disk-full     the run on a small loop-mounted ext4 (root only, else skipped with the
                reason) that fills at a random point; what it left is resumed on a disk with
                room;
  concurrent    two runs on the same swap and/or checkpoint folder at once (the first frozen
                mid-run while the second runs);
  folder-order  a durable store over two folders, resumed with the folders in the other
                order: refused, nothing changed; then in its order: identical;
  index-loss    a durable store (two folders, checkpoints every step) whose index is removed
                after a kill: a resume is refused, nothing changed; with --overwrite it resumes
                from the newest checkpoint (saying so): identical;
  takeover      a fresh durable run through one folder of another durable store (its second,
                its first, or both reversed): refused, the store unchanged and still resumable;
  index-edit    one digit of the durable index changed after a kill: the resume is refused by
                the index's own checksum, nothing changed;
  ckpt-fallback the durable store's folders emptied (a replaced disk) after a kill, with
                checkpoints every step: the resume falls back to the newest checkpoint, saying
                so, and ends identical (a restart from step 0 is silent-wrong);
  fifo          --data or --config is a FIFO or a device: refused at once (a hang is a crash).

Ranks as processes (two zinf-train ranks started by hand on this machine's loopback, as a
launcher would, against a 2-rank run of the same command as the reference):
  two-jobs      job A's rank 0 serves the rendezvous on a port; job B's rank 1 (another job
                id, or none) reaches it first: B's rank is refused at once naming the other
                job, and job A's own rank 1 then trains with it to the reference;
  rank-flags    rank 1 started with one flag of another value (--seed, --lr, --steps, --batch,
                --state-dtype, --gradient-clipping, --warmup, --grad-accum): both ranks
                refused, naming it;
  store-stranger a foreign process works rank 0's store during the rendezvous (reads keys with
                the old protocol, presents a guessed job id, sends garbage, sets keys, opens
                many connections, or connects and stays silent): it gets nothing but the
                refusal, and the job trains to the reference;
  stop-join     rank 1 stopped (SIGSTOP) while joining: rank 0 fails with a message within
                a few collective timeouts (6 s here), never waits for ever.
Two more classes there: hang (a rank that did not end in time) and foreign-access (a stranger
that was answered with anything but the refusal, or whose key was taken).

A run that ends with exit 0 but did not do what was asked counts as silent-wrong even when its
parameters match: a resume that restarted from step 0 while a commit or a checkpoint held a
later step, or one that should have been refused.

The table goes to stdout; one line per case to stderr. Exit status: 0 when no case is
silent-wrong, data-loss or crash, 1 otherwise, 2 on a usage or setup error.

  /usr/bin/python3 scripts/chaos.py --cases 200 --seed 1
"""

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
CLASSES = ["identical", "clear-error", "silent-wrong", "data-loss", "crash", "hang",
           "foreign-access", "skipped"]
BAD = {"silent-wrong", "data-loss", "crash", "hang", "foreign-access"}
KINDS = ["kill-time", "kill-point", "flip", "truncate", "remove", "disk-full", "concurrent",
         "folder-order", "index-loss", "takeover", "index-edit", "ckpt-fallback", "fifo",
         "two-jobs", "rank-flags", "store-stranger", "stop-join"]
# rank-flags: the flag rank 1 gets another value of, and what the refusal names.
RANK_FLAGS = [("--seed", "2", "zinf-train --seed"), ("--lr", "0.003", "optimizer.lr"),
              ("--steps", str(STEPS + 1), "zinf-train --steps"),
              ("--batch", "3", "zinf-train --batch"),
              ("--state-dtype", "bf16", "zinf.optimizer_state_dtype"),
              ("--gradient-clipping", "0.5", "gradient_clipping"),
              ("--warmup", "3", "zinf-train --warmup"),
              ("--grad-accum", "2", "gradient_accumulation_steps")]
STRANGERS = ["read", "guess", "garbage", "set", "flood", "silent"]
MP_TIMEOUT = 6  # zinf.collective_timeout_seconds of the stop-join cases
# Named kill points and how many times each fires in a 6-step run (roughly): a point that
# never fires leaves an uninterrupted run, which must then be identical.
CRASH_POINTS = {
    "checkpoint": [("train.backward", 12), ("optimizer.group", 6), ("swap.write", 200),
                   ("checkpoint.files", 12), ("checkpoint.renamed", 6),
                   ("checkpoint.latest", 6)],
    "durable": [("train.backward", 12), ("optimizer.group", 6), ("swap.write", 200),
                ("swap.commit", 7), ("swap.committed", 7)],
}


class Run:
    """One finished zinf-train process."""

    def __init__(self, rc, out, err, seconds, timed_out=False):
        self.rc, self.out, self.err, self.seconds, self.timed_out = rc, out, err, seconds, timed_out

    @property
    def checksum(self):
        for line in reversed(self.out.splitlines()):
            line = line.strip()
            if line.startswith("{"):
                try:
                    return json.loads(line).get("param_checksum")
                except ValueError:
                    return None
        return None

    @property
    def summary(self):
        """The final JSON line, or {}."""
        for line in reversed(self.out.splitlines()):
            line = line.strip()
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    return {}
        return {}

    @property
    def killed(self):
        return self.rc == -signal.SIGKILL

    def clear_error(self):
        """Exit 1 or 2 with a zinf-train line saying what went wrong."""
        if self.rc not in (1, 2) or self.timed_out:
            return False
        lines = [l for l in self.err.splitlines() if l.startswith("zinf-train: ")]
        return bool(lines) and len(lines[-1]) > len("zinf-train: ") + 10

    def last_error(self):
        lines = [l for l in self.err.splitlines() if l.startswith("zinf-train")]
        return lines[-1][:300] if lines else self.err.strip()[-300:]


class Campaign:
    def __init__(self, args):
        self.args = args
        self.train = args.train
        self.data = os.path.join(ROOT, "train", "data", "corpus.txt")
        self.base = tempfile.mkdtemp(prefix="zinf-chaos-", dir=args.work)
        self.env = dict(os.environ)
        self.env.pop("ZINF_CRASH_AT", None)
        self.env["OPENBLAS_NUM_THREADS"] = "1"  # results must not depend on the thread count
        self.reference = None
        self.ref_seconds = None
        self.loop_reason = self.loop_unavailable()
        self.mp_ref = None  # the 2-rank reference checksum, made by the first such case

    # ---- running zinf-train ----

    def argv(self, mode, swap, ckpt, steps=STEPS, resume=False, extra=()):
        """`swap`: a folder or a list of folders (--nvme each, in order). Mode "durable+ckpt":
        durable with a checkpoint every step too."""
        a = [self.train, "--preset", "tiny", "--steps", str(steps), "--batch", "4", "--seq",
             "32", "--warmup", "2", "--param-tier", "nvme", "--data", self.data, "--json"]
        for folder in ([swap] if isinstance(swap, str) else swap):
            a += ["--nvme", folder]
        if mode.startswith("durable"):
            a.append("--durable")
        if mode != "durable":
            a += ["--save-every", "1", "--checkpoint-dir", ckpt]
        if resume:
            a.append("--resume")
        return a + list(extra)

    def start(self, argv, crash=None):
        env = dict(self.env)
        if crash:
            env["ZINF_CRASH_AT"] = crash
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                text=True, errors="replace")

    def finish(self, proc, t0, kill_after=None):
        timed_out = False
        try:
            if kill_after is not None:
                try:
                    out, err = proc.communicate(timeout=kill_after)
                    return Run(proc.returncode, out, err, time.time() - t0)
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGKILL)
            out, err = proc.communicate(timeout=self.args.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            out, err = proc.communicate()
        return Run(proc.returncode, out, err, time.time() - t0, timed_out)

    def run(self, argv, crash=None, kill_after=None):
        t0 = time.time()
        return self.finish(self.start(argv, crash), t0, kill_after)

    # ---- files ----

    @staticmethod
    def snapshot(*dirs):
        """{path: sha256} of every regular file under `dirs` (lock files aside)."""
        snap = {}
        for d in dirs:
            for root, _, files in os.walk(d):
                for f in files:
                    if f.endswith(".lock"):
                        continue
                    p = os.path.join(root, f)
                    try:
                        with open(p, "rb") as fh:
                            snap[p] = hashlib.sha256(fh.read()).hexdigest()
                    except OSError:
                        pass
        return snap

    @staticmethod
    def targets(mode, swap, ckpt):
        """Files a fault may hit: the swap files and index, checkpoint pieces, manifests,
        latest."""
        out = []
        for d in ([swap] if mode == "durable" else [swap, ckpt]):
            for root, _, files in os.walk(d):
                out += [os.path.join(root, f) for f in files if not f.endswith(".lock")]
        return sorted(out)

    # ---- the loop-mounted small disk ----

    def loop_unavailable(self):
        if os.geteuid() != 0:
            return "not root (a loop mount needs root)"
        for tool in ("mkfs.ext4", "mount", "umount", "losetup"):
            if shutil.which(tool) is None and not os.path.exists("/sbin/" + tool):
                return tool + " not found"
        probe = os.path.join(self.base, "probe")
        os.makedirs(probe + "/mnt")
        try:
            self.mount(probe, 2 << 20)
            self.umount(probe)
        except (subprocess.CalledProcessError, OSError) as e:
            return "loop mount failed here (%s)" % e
        finally:
            shutil.rmtree(probe, ignore_errors=True)
        return None

    @staticmethod
    def mount(work, size):
        img = os.path.join(work, "disk.img")
        with open(img, "wb") as f:
            f.truncate(size)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", img],
                       check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop", img, os.path.join(work, "mnt")], check=True,
                       capture_output=True)

    @staticmethod
    def umount(work):
        # A run that just ended may keep the filesystem busy for a moment (the kernel tears its
        # io_uring, which holds the swap files, down after the process): retry, then detach
        # lazily, so that no mount and no loop device outlives the case.
        mnt = os.path.join(work, "mnt")
        for _ in range(50):
            if subprocess.run(["umount", mnt], capture_output=True).returncode == 0:
                return
            time.sleep(0.1)
        if subprocess.run(["umount", "-l", mnt], capture_output=True).returncode != 0:
            raise SystemExit("chaos: cannot unmount %s; unmount it by hand" % mnt)

    # ---- what was there to resume ----

    @staticmethod
    def committed_step(swap):
        """The step a durable store's index (in its first folder) records, or None."""
        first = swap if isinstance(swap, str) else swap[0]
        try:
            with open(os.path.join(first, "zinf-swap.index.json")) as f:
                return json.loads(json.load(f)["meta"])["step"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @staticmethod
    def checkpoint_step(ckpt):
        """The newest step of a checkpoint folder zinf wrote (step-N holding its mark)."""
        best = None
        try:
            names = os.listdir(ckpt)
        except OSError:
            return None
        for n in names:
            m = re.fullmatch(r"step-(\d{9,})(\.[1-9]\d*)?", n)
            if m and os.path.exists(os.path.join(ckpt, n, "zinf-checkpoint.mark")):
                best = max(best or 0, int(m.group(1)))
        return best

    def held_step(self, mode, swap, ckpt):
        """The latest step a resume could continue from (None: nothing known)."""
        steps = []
        if mode.startswith("durable"):
            steps.append(self.committed_step(swap))
        if mode != "durable" and ckpt:
            steps.append(self.checkpoint_step(ckpt))
        steps = [x for x in steps if x is not None]
        return max(steps) if steps else None

    # ---- the cases ----

    def classify_resume(self, resumed, before, swap, ckpt, mode, held=None):
        """After a fault and a --resume: identical, or a clear error that changed nothing.
        `held`: the step the store or checkpoints held before the resume (None: unknown); a
        resume that finished from step 0 while a later step was held restarted silently."""
        if resumed.timed_out or (resumed.rc not in (0, 1, 2)):
            return "crash", "resume: rc %s%s: %s" % (resumed.rc, " (hang)" if resumed.timed_out
                                                     else "", resumed.last_error())
        if resumed.rc == 0:
            first = resumed.summary.get("first_step")
            if held and first == 0:
                return "silent-wrong", "resumed from step 0 although step %d was held" % held
            if resumed.checksum == self.reference:
                return "identical", ""
            return "silent-wrong", "resume ended on %s, not %s" % (resumed.checksum,
                                                                  self.reference)
        if not resumed.clear_error():
            return "crash", "resume: exit %d without a clear message: %s" % (
                resumed.rc, resumed.last_error())
        # A failed resume must leave what was there: checkpoints and a durable store are the
        # user's state (the checkpoint mode's swap files are scratch, rebuilt on resume).
        after = self.snapshot(swap, ckpt)
        kept = [p for p in before if mode == "durable" or not p.startswith(swap + "/")]
        changed = [p for p in kept if after.get(p) != before[p]]
        if changed:
            return "data-loss", "a failed resume changed or removed %s (%s)" % (
                os.path.relpath(changed[0], self.base), resumed.last_error())
        return "clear-error", resumed.last_error()

    def case_kill(self, rng, work, kind):
        mode = rng.choice(["checkpoint", "durable"])
        swap, ckpt = work + "/swap", work + "/ckpt"
        argv = self.argv(mode, swap, ckpt)
        if kind == "kill-time":
            delay = rng.uniform(0.0, self.ref_seconds * 1.1)
            first = self.run(argv, kill_after=delay)
            what = "%s, SIGKILL at %.2f s" % (mode, delay)
        else:
            name, hits = rng.choice(CRASH_POINTS[mode])
            point = "%s:%d" % (name, rng.randint(1, hits))
            first = self.run(argv, crash=point)
            what = "%s, ZINF_CRASH_AT=%s" % (mode, point)
        if not first.killed:
            if first.rc == 0 and first.checksum == self.reference:
                return what + " (finished first)", "identical", ""
            if first.rc == 0:
                return what, "silent-wrong", "uninterrupted run ended on %s" % first.checksum
            return what, "crash", "rc %s: %s" % (first.rc, first.last_error())
        before = self.snapshot(swap, ckpt)
        held = self.held_step(mode, swap, ckpt)
        resumed = self.run(self.argv(mode, swap, ckpt, resume=True))
        cls, detail = self.classify_resume(resumed, before, swap, ckpt, mode, held)
        return what, cls, detail

    def case_damage(self, rng, work, kind):
        mode = rng.choice(["checkpoint", "durable"])
        swap, ckpt = work + "/swap", work + "/ckpt"
        # First a kill at a random named point, or a run that ends early, so that the files
        # are mid-training.
        if rng.random() < 0.5:
            name, hits = rng.choice(CRASH_POINTS[mode])
            point = "%s:%d" % (name, rng.randint(1, hits))
            first = self.run(self.argv(mode, swap, ckpt), crash=point)
            what = "%s, ZINF_CRASH_AT=%s" % (mode, point)
        else:
            k = rng.randint(1, STEPS - 1)
            first = self.run(self.argv(mode, swap, ckpt, steps=k))
            what = "%s, %d of %d steps" % (mode, k, STEPS)
        if not (first.killed or first.rc == 0):
            return what, "crash", "first run: rc %s: %s" % (first.rc, first.last_error())
        files = self.targets(mode, swap, ckpt)
        if not files:
            return what + ", no files", "skipped", "nothing on disk to damage"
        target = rng.choice(files)
        size = os.path.getsize(target)
        rel = os.path.relpath(target, work)
        if kind == "flip" and size > 0:
            at = rng.randrange(size)
            with open(target, "r+b") as f:
                f.seek(at)
                b = f.read(1)[0]
                f.seek(at)
                f.write(bytes([b ^ rng.randint(1, 255)]))
            what += ", byte %d of %s flipped" % (at, rel)
        elif kind == "truncate" or (kind == "flip" and size == 0):
            n = rng.randrange(size) if size > 0 else 0
            os.truncate(target, n)
            what += ", %s cut to %d of %d bytes" % (rel, n, size)
        else:
            os.remove(target)
            what += ", %s removed" % rel
        before = self.snapshot(swap, ckpt)
        held = self.held_step(mode, swap, ckpt)
        resumed = self.run(self.argv(mode, swap, ckpt, resume=True))
        cls, detail = self.classify_resume(resumed, before, swap, ckpt, mode, held)
        return what, cls, detail

    def case_disk_full(self, rng, work):
        if self.loop_reason:
            return "disk-full", "skipped", self.loop_reason
        os.makedirs(work + "/mnt")
        # From below the swap files' size to a few checkpoints past it.
        size = rng.randint(self.swap_bytes // 2, self.swap_bytes + 6 * self.ckpt_bytes)
        size = max(size, 1 << 20)
        self.mount(work, size)
        try:
            swap, ckpt = work + "/mnt/swap", work + "/mnt/ckpt"
            first = self.run(self.argv("checkpoint", swap, ckpt))
            what = "checkpoint, an ext4 of %d KiB" % (size >> 10)
            if first.rc == 0:
                if first.checksum == self.reference:
                    return what + " (had room)", "identical", ""
                return what, "silent-wrong", "ended on %s" % first.checksum
            if not first.clear_error():
                return what, "crash", "rc %s: %s" % (first.rc, first.last_error())
            # What it left must resume, on a disk with room, to the same parameters.
            shutil.copytree(ckpt, work + "/ckpt2") if os.path.isdir(ckpt) else os.makedirs(
                work + "/ckpt2")
        finally:
            self.umount(work)
        resumed = self.run(self.argv("checkpoint", work + "/swap2", work + "/ckpt2",
                                     resume=True))
        if resumed.rc == 0 and resumed.checksum == self.reference:
            return what, "clear-error", first.last_error()
        if resumed.rc == 0:
            return what, "silent-wrong", "resumed to %s" % resumed.checksum
        return what, "data-loss", "what the full disk left does not resume: " + \
            resumed.last_error()

    def case_concurrent(self, rng, work):
        variant = rng.choice(["same swap and checkpoint folders", "same swap folder",
                              "same checkpoint folder", "same durable store"])
        mode = "durable" if variant == "same durable store" else "checkpoint"
        a_swap, a_ckpt = work + "/swap", work + "/ckpt"
        b_swap = a_swap if "swap" in variant or mode == "durable" else work + "/swap-b"
        b_ckpt = a_ckpt if "checkpoint folder" in variant else work + "/ckpt-b"
        # The first run is frozen (SIGSTOP) at a random point while the second runs, so that
        # the two overlap however fast they are; then it goes on (SIGCONT). A first run that
        # ended before the freeze meets the second with its results instead (checkpoints, a
        # committed store).
        delay = rng.uniform(0.0, 0.9 * self.ref_seconds)
        t0 = time.time()
        pa = self.start(self.argv(mode, a_swap, a_ckpt))
        time.sleep(delay)
        frozen = pa.poll() is None
        if frozen:
            os.kill(pa.pid, signal.SIGSTOP)
        pb = self.start(self.argv(mode, b_swap, b_ckpt))
        rb = self.finish(pb, t0)
        if frozen:
            os.kill(pa.pid, signal.SIGCONT)
        ra = self.finish(pa, t0)
        what = "%s, the first %s at %.2f s" % (variant, "frozen" if frozen else "done", delay)
        runs = [ra, rb]
        if any(r.timed_out or r.rc not in (0, 1, 2) for r in runs):
            bad = [r for r in runs if r.timed_out or r.rc not in (0, 1, 2)][0]
            return what, "crash", "rc %s: %s" % (bad.rc, bad.last_error())
        if any(r.rc == 0 and r.checksum != self.reference for r in runs):
            return what, "silent-wrong", "a run ended on other parameters"
        if any(r.rc != 0 and not r.clear_error() for r in runs):
            return what, "crash", "a refused run said nothing clear"
        if not any(r.rc == 0 for r in runs):
            return what, "data-loss", "neither run finished: " + ra.last_error()
        refused = [r for r in runs if r.rc != 0]
        if refused:
            return what, "clear-error", refused[0].last_error()
        return what, "identical", "both finished (one after the other)"

    # ---- store identity: folders, indexes, fallbacks, inputs ----

    def interrupted_store(self, rng, work, mode):
        """A durable run over two folders (with checkpoints when `mode` is durable+ckpt),
        killed at a named point or stopped after a few steps. Returns (folders, ckpt, what) or
        a (what, class, detail) triple when the first run itself went wrong."""
        swap, ckpt = [work + "/a", work + "/b"], work + "/ckpt"
        if rng.random() < 0.5:
            name, hits = rng.choice(CRASH_POINTS["durable"])
            point = "%s:%d" % (name, rng.randint(1, hits))
            first = self.run(self.argv(mode, swap, ckpt), crash=point)
            what = "%s, ZINF_CRASH_AT=%s" % (mode, point)
        else:
            k = rng.randint(1, STEPS - 1)
            first = self.run(self.argv(mode, swap, ckpt, steps=k))
            what = "%s, %d of %d steps" % (mode, k, STEPS)
        if not (first.killed or first.rc == 0):
            return None, None, (what, "crash", "first run: rc %s: %s" % (first.rc,
                                                                         first.last_error()))
        return swap, ckpt, what

    def must_refuse(self, run, before, dirs, what, ok_cls="clear-error"):
        """A run that had to be refused: exit 0 is silent-wrong; a hang or an unclear exit a
        crash; any change to `dirs` data-loss."""
        if run.timed_out or run.rc not in (0, 1, 2):
            return what, "crash", "rc %s%s: %s" % (run.rc, " (hang)" if run.timed_out else "",
                                                   run.last_error())
        if run.rc == 0:
            return what, "silent-wrong", "it ran (exit 0, first step %s) instead of refusing" % (
                run.summary.get("first_step"))
        if not run.clear_error():
            return what, "crash", "exit %d without a clear message: %s" % (run.rc,
                                                                          run.last_error())
        after = self.snapshot(*dirs)
        changed = [p for p in before if after.get(p) != before[p]]
        if changed:
            return what, "data-loss", "the refused run changed or removed %s" % (
                os.path.relpath(changed[0], self.base))
        return what, ok_cls, run.last_error()

    def then_resumes(self, result, mode, swap, ckpt, extra=(), expect=None):
        """After a correct refusal: the store (or checkpoint) still resumes to the reference."""
        what, cls, detail = result
        if cls != "clear-error":
            return result
        held = self.held_step(mode, swap, ckpt)
        resumed = self.run(self.argv(mode, swap, ckpt, resume=True, extra=extra))
        if resumed.rc != 0:
            return what, "data-loss", "the store no longer resumes: " + resumed.last_error()
        if held and resumed.summary.get("first_step") == 0:
            return what, "silent-wrong", "resumed from step 0 although step %d was held" % held
        if expect and expect not in resumed.err:
            return what, "silent-wrong", "the resume did not say '%s'" % expect
        if resumed.checksum != self.reference:
            return what, "silent-wrong", "resumed to %s, not %s" % (resumed.checksum,
                                                                   self.reference)
        return what, "clear-error", detail

    def case_folder_order(self, rng, work):
        swap, ckpt, what = self.interrupted_store(rng, work, "durable")
        if swap is None:
            return what
        before = self.snapshot(*swap)
        reversed_run = self.run(self.argv("durable", swap[::-1], ckpt, resume=True))
        result = self.must_refuse(reversed_run, before, swap, what + ", resumed as b, a")
        return self.then_resumes(result, "durable", swap, ckpt)

    def case_index_loss(self, rng, work):
        swap, ckpt, what = self.interrupted_store(rng, work, "durable+ckpt")
        if swap is None:
            return what
        index = os.path.join(swap[0], "zinf-swap.index.json")
        if not os.path.exists(index):
            return what + ", no index yet", "skipped", "the store never committed"
        os.remove(index)
        what += ", index removed"
        before = self.snapshot(*(swap + [ckpt]))
        asked = self.run(self.argv("durable+ckpt", swap, ckpt, resume=True))
        result = self.must_refuse(asked, before, swap + [ckpt], what)
        if self.checkpoint_step(ckpt) is None:
            return result  # nothing to fall back to: the refusal is the whole answer
        # Told to replace the store: it resumes from the newest checkpoint, saying so.
        return self.then_resumes(result, "durable+ckpt", swap, ckpt, extra=["--overwrite"],
                                 expect="resuming from the newest checkpoint")

    def case_takeover(self, rng, work):
        swap, ckpt, what = self.interrupted_store(rng, work, "durable")
        if swap is None:
            return what
        if self.committed_step(swap) is None:
            return what + ", no commit", "skipped", "the store never committed"
        variant = rng.choice([[work + "/z", swap[1]], [swap[1]], [swap[0]], swap[::-1]])
        what += ", a fresh run on " + ", ".join(os.path.basename(p) for p in variant)
        before = self.snapshot(*swap)
        mode = rng.choice(["durable", "checkpoint"])  # a scratch store must not take it either
        fresh = self.run(self.argv(mode, variant, work + "/ckpt2"))
        result = self.must_refuse(fresh, before, swap, what + " (%s)" % mode)
        if result[1] == "silent-wrong":
            result = (result[0], "data-loss", "a fresh run took over the store's folder")
        return self.then_resumes(result, "durable", swap, ckpt)

    def case_index_edit(self, rng, work):
        swap, ckpt, what = self.interrupted_store(rng, work, "durable")
        if swap is None:
            return what
        index = os.path.join(swap[0], "zinf-swap.index.json")
        if not os.path.exists(index):
            return what + ", no index yet", "skipped", "the store never committed"
        with open(index) as f:
            text = f.read()
        digits = [i for i, c in enumerate(text) if c.isdigit()]
        at = rng.choice(digits)
        new = str((int(text[at]) + rng.randint(1, 9)) % 10)
        with open(index, "w") as f:
            f.write(text[:at] + new + text[at + 1:])
        what += ", index digit %d: %s -> %s" % (at, text[at], new)
        before = self.snapshot(*swap)
        resumed = self.run(self.argv("durable", swap, ckpt, resume=True))
        return self.must_refuse(resumed, before, swap, what)

    def case_ckpt_fallback(self, rng, work):
        swap, ckpt, what = self.interrupted_store(rng, work, "durable+ckpt")
        if swap is None:
            return what
        for folder in swap:
            shutil.rmtree(folder, ignore_errors=True)
        what += ", swap folders emptied"
        held = self.checkpoint_step(ckpt)
        before = self.snapshot(ckpt)
        resumed = self.run(self.argv("durable+ckpt", swap, ckpt, resume=True))
        if held is None:
            # Nothing to resume from anywhere: refused (a fresh start needs no --resume).
            return self.must_refuse(resumed, before, [ckpt], what + ", no checkpoint")
        if resumed.timed_out or resumed.rc not in (0, 1, 2):
            return what, "crash", "rc %s: %s" % (resumed.rc, resumed.last_error())
        if resumed.rc != 0:
            return what, "data-loss", "the checkpoints do not resume: " + resumed.last_error()
        if resumed.summary.get("first_step") == 0:
            return what, "silent-wrong", "restarted from step 0 with checkpoints at step %d" % held
        if "resuming from the newest checkpoint" not in resumed.err:
            return what, "silent-wrong", "the fallback to the checkpoints was not said"
        if resumed.checksum != self.reference:
            return what, "silent-wrong", "ended on %s" % resumed.checksum
        return what, "identical", "resumed from the checkpoint at step %s" % (
            resumed.summary.get("first_step"))

    def case_fifo(self, rng, work):
        fifo = os.path.join(work, rng.choice(["data.txt", "ds_config.json", "model.safetensors"]))
        os.mkfifo(fifo)
        flag = rng.choice(["--data", "--config"])
        # (--config takes an existing file: a folder is CLI11's usage error before zinf runs.)
        target = rng.choice([fifo, "/dev/zero", "/dev/null"] + ([work] if flag == "--data" else []))
        argv = self.argv("checkpoint", work + "/swap", work + "/ckpt", steps=1)
        if flag == "--data":
            argv[argv.index("--data") + 1] = target
        else:
            argv += ["--config", target]
        what = "%s %s" % (flag, os.path.relpath(target, work) if target.startswith(work)
                          else target)
        t0 = time.time()
        run = self.finish(self.start(argv), t0, kill_after=None)
        if run.timed_out:
            return what, "crash", "hang"
        if run.rc == 0:
            if flag == "--config" and target == "/dev/null":
                return what, "silent-wrong", "an empty device read as a config"
            return what, "silent-wrong", "it ran on a %s" % target
        if run.rc != 2 or not run.clear_error():
            return what, "crash", "rc %s: %s" % (run.rc, run.last_error())
        return what, "clear-error", run.last_error()

    # ---- ranks as processes ----

    def mp_argv(self, swap, extra=()):
        return [self.train, "--preset", "tiny", "--steps", str(STEPS), "--batch", "2", "--seq",
                "32", "--warmup", "2", "--lr", "0.001", "--param-tier", "nvme", "--data",
                self.data, "--json", "--nvme", swap] + list(extra)

    def start_rank(self, argv, rank, port=None, folder=None, job=None):
        env = {k: v for k, v in self.env.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                            "MASTER_ADDR", "MASTER_PORT", "ZINF_JOB_ID", "ZINF_STORE_FOLDER")}
        env.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": "2"})
        if port is not None:
            env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        if folder is not None:
            env["ZINF_STORE_FOLDER"] = folder
        if job is not None:
            env["ZINF_JOB_ID"] = job
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                text=True, errors="replace")

    def mp_reference(self):
        if self.mp_ref is None:
            work = os.path.join(self.base, "mp-reference")
            r = self.run(self.mp_argv(work + "/swap", ["--nproc", "2"]))
            shutil.rmtree(work, ignore_errors=True)
            if r.rc != 0 or not r.checksum:
                raise SystemExit("chaos: the 2-rank reference run failed (rc %s): %s"
                                 % (r.rc, r.last_error()))
            self.mp_ref = r.checksum
        return self.mp_ref

    @staticmethod
    def free_port():
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    @staticmethod
    def wait_listening(port, proc, seconds=60):
        """Until something accepts connections on 127.0.0.1:port (rank 0's store)."""
        import socket
        until = time.time() + seconds
        while time.time() < until and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return True
            except OSError:
                time.sleep(0.02)
        return False

    def rank_outcome(self, run, must_fail, names=None, rank=0):
        """A rank's class: (class, detail). Rank 0 reports the run's checksum."""
        if run.timed_out:
            return "hang", "no end after %.0f s" % self.args.timeout
        if run.rc == 0:
            if must_fail:
                return "silent-wrong", "it trained (exit 0) instead of refusing"
            if rank == 0 and run.checksum != self.mp_reference():
                return "silent-wrong", "ended on %s, not %s" % (run.checksum, self.mp_ref)
            return "identical", ""
        if not run.clear_error():
            return "crash", "rc %s: %s" % (run.rc, run.last_error())
        if not must_fail:
            return "crash", "a rank that had to train failed: " + run.last_error()
        if names and names not in run.err:
            return "crash", "the refusal does not name %r: %s" % (names, run.last_error())
        return "clear-error", run.last_error()

    @staticmethod
    def worst(outcomes):
        order = ["foreign-access", "hang", "crash", "data-loss", "silent-wrong", "clear-error",
                 "identical"]
        return min(outcomes, key=lambda o: order.index(o[0]))

    def case_two_jobs(self, rng, work):
        self.mp_reference()
        port = self.free_port()
        b_job = rng.choice(["job-b", None])
        what = "job B's rank 1 (%s) reaches job A's store first" % (
            "job id job-b" if b_job else "no job id")
        t0 = time.time()
        a0 = self.start_rank(self.mp_argv(work + "/a"), 0, port=port, job="job-a")
        outcomes = []
        if not self.wait_listening(port, a0):
            run = self.finish(a0, t0)
            return what, "crash", "job A's rank 0 never served its store: " + run.last_error()
        b1 = self.start_rank(self.mp_argv(work + "/b"), 1, port=port, job=b_job)
        outcomes.append(self.rank_outcome(self.finish(b1, time.time()), True, "another job"))
        a1 = self.start_rank(self.mp_argv(work + "/a"), 1, port=port, job="job-a")
        outcomes.append(self.rank_outcome(self.finish(a0, t0), False))
        outcomes.append(self.rank_outcome(self.finish(a1, t0), False, rank=1))
        cls, detail = self.worst(outcomes)
        return what, ("identical" if cls in ("identical", "clear-error") else cls), detail

    def case_rank_flags(self, rng, work):
        flag, value, names = rng.choice(RANK_FLAGS)
        what = "rank 1 with %s %s" % (flag, value)
        folder = os.path.join(work, "store")
        os.makedirs(folder)
        argv0 = self.mp_argv(work + "/swap")
        argv1 = list(argv0)
        if flag in argv1:
            argv1[argv1.index(flag) + 1] = value
        else:
            argv1 += [flag, value]
        t0 = time.time()
        ranks = [self.start_rank(argv0, 0, folder=folder), self.start_rank(argv1, 1, folder=folder)]
        outcomes = [self.rank_outcome(self.finish(p, t0), True, names) for p in ranks]
        return (what,) + self.worst(outcomes)

    def stranger(self, how, port):
        """What a foreign process gets from rank 0's store: (bytes received, sockets to close
        once the job is done)."""
        import socket
        import struct

        def field(b):
            return struct.pack("=I", len(b)) + b

        def talk(payload, keep=False):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            got = b""
            try:
                if payload:
                    sock.sendall(payload)
                if keep:
                    return got, sock
                sock.settimeout(15)
                while True:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    got += chunk
            except OSError:
                pass  # reset by the store: what it sent is in `got`
            sock.close()
            return got, None

        if how == "read":  # the old protocol's GET of gloo's keys
            got = b""
            for key in (b"zinf/rank_0", b"zinf/0", b"zinf/member/0"):
                got += talk(b"\x02" + field(key))[0]
            return got, []
        if how == "guess":
            return talk(b"ZINFKV02" + field(b"guess") + b"\x02" + field(b"zinf/0"))[0], []
        if how == "garbage":
            return talk(bytes(random.Random(port).getrandbits(8) for _ in range(5000)))[0], []
        if how == "set":  # a SET under a guessed id, then without any hello
            got = talk(b"ZINFKV02" + field(b"") + b"\x01" + field(b"zinf/member/1") +
                       field(b"intruder 1"))[0]
            return got + talk(b"\x01" + field(b"zinf/1") + field(b"\0" * 64))[0], []
        keep = []
        for _ in range(200 if how == "flood" else 1):
            try:
                keep.append(talk(b"", keep=True)[1])
            except OSError:
                break  # refused: the store closes what is over its bound
        return b"", keep

    def case_store_stranger(self, rng, work):
        self.mp_reference()
        how = rng.choice(STRANGERS)
        what = "a stranger (%s) at rank 0's store" % how
        port = self.free_port()
        t0 = time.time()
        a0 = self.start_rank(self.mp_argv(work + "/swap"), 0, port=port, job="the-job")
        if not self.wait_listening(port, a0):
            run = self.finish(a0, t0)
            return what, "crash", "rank 0 never served its store: " + run.last_error()
        got, keep = self.stranger(how, port)
        a1 = self.start_rank(self.mp_argv(work + "/swap"), 1, port=port, job="the-job")
        outcomes = [self.rank_outcome(self.finish(a0, t0), False),
                    self.rank_outcome(self.finish(a1, t0), False, rank=1)]
        for sock in keep:
            sock.close()
        refusal = b"\x02" if how == "guess" else (b"\x02" if how == "set" else b"")
        if got != refusal:
            outcomes.append(("foreign-access", "the stranger got %r" % got[:80]))
        return (what,) + self.worst(outcomes)

    def case_stop_join(self, rng, work):
        delay = rng.uniform(0.0, 1.5)
        what = "rank 1 stopped %.1f s after its start" % delay
        folder = os.path.join(work, "store")
        os.makedirs(folder)
        config = os.path.join(work, "config.json")
        with open(config, "w") as f:
            json.dump({"zinf": {"collective_timeout_seconds": MP_TIMEOUT}}, f)
        argv = self.mp_argv(work + "/swap", ["--config", config])
        t0 = time.time()
        r1 = self.start_rank(argv, 1, folder=folder)
        time.sleep(delay)
        r1.send_signal(signal.SIGSTOP)
        r0 = self.start_rank(argv, 0, folder=folder)
        try:
            out, err = r0.communicate(timeout=20 * MP_TIMEOUT)
            run = Run(r0.returncode, out, err, time.time() - t0)
        except subprocess.TimeoutExpired:
            r0.kill()
            out, err = r0.communicate()
            run = Run(r0.returncode, out, err, time.time() - t0, timed_out=True)
        r1.kill()  # our own child, by its handle
        r1.communicate()
        if run.timed_out:
            return what, "hang", "rank 0 still waiting after %d s" % (20 * MP_TIMEOUT)
        if run.rc == 0:
            return what, "silent-wrong", "rank 0 finished with its peer stopped"
        if not run.clear_error():
            return what, "crash", "rc %s: %s" % (run.rc, run.last_error())
        return what, "clear-error", run.last_error()

    # ---- the campaign ----

    def prepare(self):
        work = os.path.join(self.base, "reference")
        r = self.run(self.argv("checkpoint", work + "/swap", work + "/ckpt"))
        if r.rc != 0 or not r.checksum:
            raise SystemExit("chaos: the uninterrupted run failed (rc %s): %s" %
                             (r.rc, r.last_error()))
        d = self.run(self.argv("durable", work + "/dswap", None))
        if d.rc != 0 or d.checksum != r.checksum:
            raise SystemExit("chaos: the durable run (rc %s) ended on %s, the checkpointed on %s"
                             % (d.rc, d.checksum, r.checksum))
        # The first run of a session pays for cold caches: the kill times follow the faster.
        self.reference, self.ref_seconds = r.checksum, min(r.seconds, d.seconds)
        per_folder = {}
        for p in self.snapshot(work + "/ckpt"):
            top = os.path.relpath(p, work + "/ckpt").split(os.sep)[0]
            per_folder[top] = per_folder.get(top, 0) + os.path.getsize(p)
        self.ckpt_bytes = max(per_folder.values())  # one checkpoint (step-N folder)
        self.swap_bytes = sum(os.path.getsize(p) for p in self.snapshot(work + "/dswap"))
        shutil.rmtree(work, ignore_errors=True)

    def one(self, i):
        rng = random.Random("%d/%d" % (self.args.seed, i))
        kind = KINDS[i % len(KINDS)] if self.args.kind is None else self.args.kind
        work = os.path.join(self.base, "case-%d" % i)
        os.makedirs(work)
        t0 = time.time()
        if kind in ("kill-time", "kill-point"):
            what, cls, detail = self.case_kill(rng, work, kind)
        elif kind in ("flip", "truncate", "remove"):
            what, cls, detail = self.case_damage(rng, work, kind)
        elif kind == "disk-full":
            what, cls, detail = self.case_disk_full(rng, work)
        elif kind == "concurrent":
            what, cls, detail = self.case_concurrent(rng, work)
        else:
            what, cls, detail = getattr(self, "case_" + kind.replace("-", "_"))(rng, work)
        if cls in BAD and self.args.keep:
            print("  kept %s" % work, file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
        return kind, what, cls, detail, time.time() - t0

    def main(self):
        self.prepare()
        print("chaos: reference %s (%.1f s uninterrupted), seed %d, %d cases, work %s" %
              (self.reference, self.ref_seconds, self.args.seed, self.args.cases, self.base),
              file=sys.stderr)
        if self.loop_reason:
            print("chaos: disk-full cases skipped: %s" % self.loop_reason, file=sys.stderr)
        table = {k: {c: 0 for c in CLASSES} for k in KINDS}
        bad = []
        for i in range(self.args.cases):
            kind, what, cls, detail, secs = self.one(i)
            table[kind][cls] += 1
            line = "[%d/%d] %-10s %-12s %s (%.1f s)%s" % (
                i + 1, self.args.cases, kind, cls, what, secs,
                ("\n      " + detail) if detail and (cls != "identical") else "")
            print(line, file=sys.stderr, flush=True)
            if cls in BAD:
                bad.append(line)
        shutil.rmtree(self.base, ignore_errors=True)
        print("| kind | " + " | ".join(CLASSES) + " |")
        print("| --- |" + " --- |" * len(CLASSES))
        total = {c: 0 for c in CLASSES}
        for k in KINDS:
            if sum(table[k].values()) == 0:
                continue
            print("| %s | %s |" % (k, " | ".join(str(table[k][c]) for c in CLASSES)))
            for c in CLASSES:
                total[c] += table[k][c]
        print("| all | %s |" % " | ".join(str(total[c]) for c in CLASSES))
        if bad:
            print("\nFAILED cases:\n" + "\n".join(bad))
            return 1
        return 0


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="exit status: 0 no silent-wrong, data-loss or crash "
                                       "case; 1 some; 2 usage or setup error")
    p.add_argument("--cases", type=int, default=200, help="how many cases (default 200)")
    p.add_argument("--seed", type=int, default=1, help="campaign seed (default 1)")
    p.add_argument("--kind", choices=KINDS, help="only this kind of fault")
    p.add_argument("--train", default=os.path.join(ROOT, "build", "train", "zinf-train"),
                   help="the zinf-train binary (default build/train/zinf-train)")
    p.add_argument("--work", default=os.environ.get("TMPDIR", "/var/tmp"),
                   help="folder for the cases' files (default $TMPDIR or /var/tmp)")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds before a run counts as hung (default 300)")
    p.add_argument("--keep", action="store_true", help="keep the files of failed cases")
    a = p.parse_args()
    if a.cases < 1:
        p.error("--cases must be at least 1")
    if not os.access(a.train, os.X_OK):
        p.error("%s is not an executable (build first: scripts/build.sh)" % a.train)
    if not os.path.isdir(a.work):
        p.error("--work %s is not a folder" % a.work)
    return a


if __name__ == "__main__":
    campaign = Campaign(parse())
    try:
        sys.exit(campaign.main())
    finally:
        shutil.rmtree(campaign.base, ignore_errors=True)
