#!/usr/bin/env python3
"""Trains (or fine-tunes) a Llama-style model of any size on a text file with zinf, from
PyTorch: the model is built under zinf.Init (its parameters go to zinf's stores as they are
created, so it may be larger than host memory), optionally loaded from safetensors, and
trained with zinf's optimizer; parameters and optimizer states live on NVMe by default.

    python3 python/examples/finetune.py --preset 1B --steps 3
    python3 python/examples/finetune.py --layers 4 --dim 256 --steps 50 --param-tier cpu
    python3 python/examples/finetune.py --preset 3B --steps 3 --nvme /mnt/nvme --json
    python3 python/examples/finetune.py --preset 7B --lora 16 --load llama-7b/ --save-dir out

Tokens are the file's bytes (vocabulary 256, as zinf-train), so no tokenizer is needed; with
--load, a checkpoint in Hugging Face Llama names (or one --save wrote) loads by name (the
shapes, vocabulary, rope_theta, rms_norm_eps and tied embeddings then come from the Hugging
Face config.json beside the weights, tensors the model does not use are named, and the text is
still read as bytes: bring your own tokens for a real fine-tune). One line per step: loss,
tokens/s, NVMe GB/s (read + write), overlap efficiency, step time. At the end one JSON line like
zinf-train's.

Under a launcher (python3 -m zinf.launch --nproc_per_node N python/examples/finetune.py ...)
each rank trains on its own batches (--batch sequences per rank and micro-step) and rank 0
reports. The pinned host budget is sized to what the model needs unless --pinned-budget says.

--lora RANK trains LoRA adapters (lora.py beside this file: no peft) on the attention's
q and v projections and the MLP's three (--lora-targets), with everything else frozen
(requires_grad=False before zinf.initialize: zinf keeps a frozen parameter as data, no master,
no optimizer states, never written back). --save-dir then exports the adapters alone.
"""
import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import zinf
    from zinf.models import Llama
except ImportError as e:
    raise SystemExit("finetune: cannot import zinf (%s): pip install ./python, or run with "
                     "PYTHONPATH=build/python after scripts/build.sh" % e)
sys.path.insert(0, HERE)
from lora import LORA_TARGETS, add_lora  # noqa: E402 (beside this file)

# Llama shapes (dim, layers, heads, kv heads, MLP hidden); vocabulary 256 unless loaded.
PRESETS = {
    "tiny": (128, 2, 4, 2, 384),
    "small": (512, 8, 8, 4, 1408),
    "1B": (2048, 18, 16, 8, 5632),
    "3B": (3200, 26, 32, 32, 8640),  # the open_llama_3b shape: 3.2B parameters
    "7B": (4096, 32, 32, 32, 11008),
}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--dim", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--hidden", type=int, help="MLP width")
    ap.add_argument("--vocab", type=int, help="vocabulary (default 256, or the loaded one)")
    ap.add_argument("--data", default=os.path.join(HERE, "..", "..", "train", "data",
                                                   "corpus.txt"), help="a text file")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-step")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--schedule", choices=["auto", "layer-major", "micro-batch"],
                    default="auto",
                    help="zinf.schedule: layer-major runs each block for every micro-batch of "
                    "the window before the next (engine.train_window: each parameter fetched "
                    "once per pass whatever --grad-accum; the block inputs kept, each block run "
                    "again in the backward); micro-batch runs one micro-batch at a time; auto "
                    "(default): layer-major with --grad-accum above 1, parameters offloaded "
                    "and an untied head, else micro-batch. The same bits either way")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=5, help="linear warmup steps")
    ap.add_argument("--clip", type=float, default=0.0,
                    help="gradient clipping by global norm (default off: clipping waits for "
                         "every gradient, so all of them stay in pinned memory, 4 bytes a "
                         "parameter)")
    ap.add_argument("--config", help="a DeepSpeed-style JSON config (the flags below override)")
    ap.add_argument("--nvme", default="zinf-swap", help="folder for the swap files")
    ap.add_argument("--param-tier", choices=["device", "cpu", "nvme"], default="nvme")
    ap.add_argument("--optimizer-tier", choices=["device", "cpu", "nvme"], default="nvme")
    ap.add_argument("--fp32", action="store_true", help="fp32 parameters (default bf16)")
    ap.add_argument("--pinned-budget", default=None,
                    help="pinned host memory (default: what the model needs, at least 128M)")
    ap.add_argument("--device-budget", default=None)
    ap.add_argument("--sub-group-size", type=float, default=2.5e7)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--load", help="a .safetensors file, index or folder (HF Llama names)")
    ap.add_argument("--save", "--save-dir", dest="save",
                    help="export the trained weights as safetensors here (with --lora: the "
                         "adapters alone, fp32)")
    ap.add_argument("--lora", type=int, metavar="RANK", help="train LoRA adapters of this "
                    "rank, the rest frozen")
    ap.add_argument("--lora-alpha", type=float, help="LoRA's alpha (default 2 x RANK: "
                    "scaling alpha/RANK = 2 whatever the rank)")
    ap.add_argument("--lora-targets", default="q,v,mlp",
                    help="comma-separated, of %s (mlp: gate, up and down)"
                         % ",".join(sorted(LORA_TARGETS)))
    ap.add_argument("--frozen-weight-dtype", choices=["as-is", "int8"],
                    help="config zinf.frozen_weight_dtype: how frozen weights are stored "
                         "(default: the engine's, as-is)")
    ap.add_argument("--checkpoint-dir")
    ap.add_argument("--resume", action="store_true", help="from --checkpoint-dir's newest")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    args = ap.parse_args()
    args.hf, args.hf_path = hf_config(args.load) if args.load else ({}, None)
    for key, value in args.hf.items():
        given = getattr(args, key, None)
        if key in ("rope_theta", "eps", "tie"):
            continue
        if given is not None and given != value:
            ap.error("--%s %d, but %s says %d" % (key.replace("_", "-"), given,
                                                  args.hf_path, value))
        setattr(args, key, value)
    args.vocab = args.vocab or 256
    dim, layers, heads, kv, hidden = PRESETS[args.preset]
    args.dim = args.dim or dim
    args.layers = args.layers or layers
    args.heads = args.heads or heads
    args.kv_heads = args.kv_heads or (kv if args.heads == heads else args.heads)
    args.hidden = args.hidden or (hidden if args.dim == dim else 256 * math.ceil(8 * args.dim / 3 / 256))
    for name in ("seq", "batch", "grad_accum", "steps", "layers", "dim", "heads"):
        if getattr(args, name) < 1:
            ap.error("--%s must be at least 1" % name.replace("_", "-"))
    if args.dim % args.heads or args.heads % args.kv_heads:
        ap.error("--dim must be a multiple of --heads, and --heads of --kv-heads")
    if not (args.lr >= 0 and math.isfinite(args.lr)) or args.warmup < 0 or args.clip < 0:
        ap.error("--lr, --warmup and --clip must be finite and >= 0")
    if args.resume and not args.checkpoint_dir:
        ap.error("--resume needs --checkpoint-dir")
    if args.schedule == "auto":
        stackable = not args.hf.get("tie", False)
        args.schedule = ("layer-major" if args.grad_accum > 1 and args.param_tier != "device"
                         and stackable else "micro-batch")
    elif args.schedule == "layer-major" and args.hf.get("tie", False):
        ap.error("--schedule layer-major: %s ties the head to the embedding; tied models train "
                 "on the micro-batch schedule" % args.hf_path)
    args.lora_targets = [t for t in args.lora_targets.split(",") if t]
    if args.lora is not None:
        if args.lora < 1:
            ap.error("--lora must be at least 1")
        if not args.lora_targets or set(args.lora_targets) - set(LORA_TARGETS):
            ap.error("--lora-targets: a comma-separated list of %s" % ",".join(LORA_TARGETS))
        if args.lora_alpha is None:
            args.lora_alpha = 2.0 * args.lora
    return args


# Hugging Face config.json keys -> this script's.
HF_KEYS = {"hidden_size": "dim", "num_hidden_layers": "layers", "num_attention_heads": "heads",
           "num_key_value_heads": "kv_heads", "intermediate_size": "hidden",
           "vocab_size": "vocab", "rope_theta": "rope_theta", "rms_norm_eps": "eps",
           "tie_word_embeddings": "tie"}


def hf_config(load):
    """The model's shape from the config.json beside `load` (a folder, or a file in one), as
    this script's names, and that file's path; ({}, None) when there is none."""
    folder = load if os.path.isdir(load) else os.path.dirname(os.path.abspath(load))
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return {}, None
    with open(path) as f:
        hf = json.load(f)
    if hf.get("model_type", "llama") not in ("llama", "mistral"):
        raise SystemExit("finetune: %s describes a %s model; this script builds Llama"
                         % (path, hf.get("model_type")))
    if hf.get("rope_scaling"):
        raise SystemExit("finetune: %s asks for rope_scaling %s, which zinf.models.Llama does "
                         "not implement" % (path, hf["rope_scaling"]))
    return {ours: hf[theirs] for theirs, ours in HF_KEYS.items() if theirs in hf}, path


def make_config(args):
    cfg = {}
    if args.config:
        with open(args.config) as f:
            cfg = json.load(f)
    zo = cfg.setdefault("zero_optimization", {})
    zo["stage"] = 3
    tiers = {"device": "none", "cpu": "cpu", "nvme": "nvme"}
    zo.setdefault("offload_param", {})["device"] = tiers[args.param_tier]
    zo.setdefault("offload_optimizer", {})["device"] = tiers[args.optimizer_tier]
    for key in ("offload_param", "offload_optimizer"):
        if zo[key]["device"] == "nvme":
            zo[key]["nvme_path"] = args.nvme
    zo.setdefault("sub_group_size", args.sub_group_size)
    zo.setdefault("stage3_prefetch_bucket_size", 1e8)
    zo.setdefault("stage3_max_live_parameters", 4e8)
    cfg.setdefault("aio", {"block_size": 8 << 20, "queue_depth": 32})
    cfg.setdefault("optimizer", {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}})
    cfg["gradient_accumulation_steps"] = args.grad_accum
    cfg["gradient_clipping"] = args.clip
    cfg["bf16"] = {"enabled": not args.fp32}
    z = cfg.setdefault("zinf", {})
    z["schedule"] = args.schedule
    if args.pinned_budget is not None:
        z.setdefault("pinned_budget_bytes", args.pinned_budget)
    if args.device_budget:
        z["device_budget_bytes"] = args.device_budget
    if args.frozen_weight_dtype:
        z["frozen_weight_dtype"] = args.frozen_weight_dtype
    return cfg


class Batches:
    """Random windows of the file's bytes, seeded per step (a resumed run sees the same)."""

    def __init__(self, path, seq, batch, seed):
        with open(path, "rb") as f:
            data = f.read()
        if len(data) < seq + 2:
            raise SystemExit("finetune: %s has %d bytes, fewer than --seq + 2" % (path, len(data)))
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq, self.batch, self.seed = seq, batch, seed

    def get(self, step, micro, rank=0):
        g = torch.Generator().manual_seed(self.seed * 1000003 + step * 1009 + micro +
                                          rank * 7919)
        starts = torch.randint(0, len(self.data) - self.seq - 1, (self.batch,), generator=g)
        rows = torch.stack([self.data[s:s + self.seq + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]


def pinned_for(model, cfg, device):
    """A pinned host budget for this model: what the engine needs (gradient partitions,
    cpu-tier parameters, swap buffers, staging) with a quarter more, in 64 MiB steps, at least
    128 MiB."""
    specs = [(n, list(p.shape), p.requires_grad) for n, p in model.named_parameters()]
    host = device == "cpu" or (device is None and not zinf.cuda_available())
    need = zinf._zinf.pinned_bytes_needed(json.dumps(cfg), specs, host)
    step = 64 << 20
    return max(128 << 20, -(-(need + need // 4) // step) * step)


def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rank = int(os.environ.get("RANK", "0"))
    out = sys.stderr if args.json else sys.stdout
    if rank != 0:
        out = open(os.devnull, "w")  # rank 0 reports
    cfg = make_config(args)
    if "nvme" in (args.param_tier, args.optimizer_tier):
        os.makedirs(args.nvme, exist_ok=True)
    torch.manual_seed(args.seed)
    vocab = args.vocab
    if args.load:
        tensors = zinf._zinf.Safetensors(args.load).tensors()
        for name in ("model.embed_tokens.weight", "embed_tokens.weight"):
            if name in tensors:
                vocab = tensors[name][1][0]
    t0 = time.time()
    with zinf.Init(cfg):
        model = Llama(vocab=vocab, dim=args.dim, layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, hidden=args.hidden, max_seq=args.seq,
                      rope_theta=args.hf.get("rope_theta", 10000.0),
                      eps=args.hf.get("eps", 1e-6), tie_embeddings=args.hf.get("tie", False))
        if args.lora:
            add_lora(model, args.lora, args.lora_alpha, args.lora_targets)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print("finetune: Llama %d layers, dim %d, %d/%d heads, MLP %d, vocabulary %d: %d parameters "
          "(%.3g B); parameters on %s (%s), optimizer states on %s; batch %d x seq %d"
          % (args.layers, args.dim, args.heads, args.kv_heads, args.hidden, vocab, params,
             params / 1e9, args.param_tier, "fp32" if args.fp32 else "bf16", args.optimizer_tier,
             args.batch, args.seq), file=out, flush=True)
    if args.lora:
        print("finetune: LoRA rank %d, alpha %g on %s: %d trainable, %d frozen parameters"
              % (args.lora, args.lora_alpha, ",".join(args.lora_targets), trainable,
                 params - trainable), file=out, flush=True)
    if args.pinned_budget is None:
        cfg["zinf"]["pinned_budget_bytes"] = pinned_for(model, cfg, args.device)
    engine = zinf.initialize(model, cfg, device=args.device)
    if args.load:
        hf = any(k.startswith("model.") for k in tensors)  # HF names, else --save's own
        report = zinf.load_safetensors(
            engine, args.load, strict=False,
            name_map=lambda n: n if n.startswith("lm_head") or not hf else "model." + n)
        missing = [n for n in report["missing"] if not n.endswith((".lora_A", ".lora_B"))]
        print("finetune: loaded %d tensors from %s (%d missing%s)"
              % (len(report["loaded"]), args.load, len(missing),
                 ", besides the new adapters" if args.lora else ""), file=out)
        if report["unexpected"]:
            print("finetune: not used (no such tensor in this model): %s%s"
                  % (", ".join(report["unexpected"][:8]),
                     " and %d more" % (len(report["unexpected"]) - 8)
                     if len(report["unexpected"]) > 8 else ""), file=out)
    first = 0
    if args.resume:
        try:
            first = (engine.load_checkpoint(args.checkpoint_dir) or {}).get("step", 0)
            print("finetune: resumed at step %d" % first, file=out)
        except zinf.ZinfError as e:
            if e.code != "NotFound":
                raise
    data = Batches(args.data, args.seq, args.batch, args.seed)
    device = engine.device
    tokens = args.batch * args.seq * args.grad_accum * engine.world_size
    losses, seconds, gbps, overlap, details, reads, writes = [], [], [], [], [], [], []
    init_seconds = None
    for step in range(first, args.steps):
        lr = args.lr * min(1.0, (step + 1) / max(1, args.warmup))
        engine.set_lr(lr)
        t = time.time()
        loss_sum, read, written, eff = 0.0, 0, 0, []
        runs = []  # (the micro-batches' losses, the engine's statistics) per engine.step()
        batches = [tuple(z.to(device) for z in data.get(step, micro, engine.rank))
                   for micro in range(args.grad_accum)]
        if args.schedule == "layer-major":
            micro_losses = engine.train_window(batches, *model.stack())
            runs.append((micro_losses, engine.step()))
        else:
            for x, y in batches:
                loss = engine(x, y)
                if init_seconds is None:
                    init_seconds = time.time() - t0
                engine.backward(loss)
                runs.append(([loss], engine.step()))
        if init_seconds is None:
            init_seconds = time.time() - t0
        for micro_losses, stats in runs:
            for loss in micro_losses:
                loss_sum += loss.item() / args.grad_accum
            read += stats["nvme_read_bytes"]
            written += stats["nvme_write_bytes"]
            eff.append(stats["overlap_efficiency"])
            details.append({k: round(v, 3) if isinstance(v, float) else v
                            for k, v in stats.items() if k.endswith(("seconds", "bytes", "hits",
                                                                     "misses"))})
        dt = time.time() - t
        losses.append(loss_sum)
        seconds.append(dt)
        gbps.append((read + written) / dt / 1e9)
        reads.append(read)
        writes.append(written)
        overlap.append(sum(eff) / len(eff))
        print("step %4d  loss %.4f  %8.0f tokens/s  NVMe %5.2f GB/s  overlap %.2f  %.1f s  "
              "lr %.2e" % (step + 1, loss_sum, tokens / dt, gbps[-1], overlap[-1], dt, lr),
              file=out, flush=True)
        if args.checkpoint_dir:
            engine.save_checkpoint(args.checkpoint_dir, {"step": step + 1})
    if args.save and args.lora:
        zinf.save_safetensors(engine, args.save, trainable_only=True)
    elif args.save:
        zinf.save_safetensors(engine, args.save,
                              dtype=torch.float32 if args.fp32 else torch.bfloat16)
    later = slice(1, None) if len(seconds) > 1 else slice(None)
    summary = {
        "params": params,
        "trainable_params": trainable,
        "frozen_params": params - trainable,
        "lora": {"rank": args.lora, "alpha": args.lora_alpha, "targets": args.lora_targets}
        if args.lora else None,
        "frozen_weight_dtype": cfg["zinf"].get("frozen_weight_dtype", "as-is"),
        "pinned_budget_bytes": engine.config.summary["pinned_budget_bytes"],
        "world_size": engine.world_size,
        "grad_accum": args.grad_accum,
        "schedule": args.schedule,
        "steps": len(losses),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "losses": losses,
        "tokens_per_s": tokens * len(seconds[later]) / sum(seconds[later]) if seconds else 0,
        "nvme_gbps": sum(gbps[later]) / len(gbps[later]) if gbps else 0,
        "overlap_efficiency": sum(overlap[later]) / len(overlap[later]) if overlap else 0,
        "step_seconds": seconds,
        # Medians over the steps after the first (the first fetches everything cold).
        "step_seconds_median": statistics.median(seconds[later]) if seconds else None,
        "nvme_read_bytes_per_step": statistics.median(reads[later]) if reads else None,
        "nvme_write_bytes_per_step": statistics.median(writes[later]) if writes else None,
        "init_seconds": init_seconds,
        "engine_stats": details,
        "peak_rss_bytes": peak_rss(),
    }
    if engine.rank == 0:
        print(json.dumps(summary), flush=True)
    if losses and not math.isfinite(losses[-1]):
        print("finetune: the loss is not finite; lower --lr", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
