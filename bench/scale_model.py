#!/usr/bin/env python3
"""bench/scale_model.py: an analytic performance model. A MODEL ON PAPER, NOT A MEASUREMENT.

Predicts the step time and bottleneck of ZeRO-3 training with parameter and optimizer-state
offload as zinf does it (bf16 parameters all-gathered per layer, gradients reduce-scattered to
pinned fp32 host accumulators, fp32 master + Adam states in CPU memory or on NVMe, SIMD CPU
Adam) for a 1T model on 64 x 8 H100s and a 70B fine-tune on one 8-GPU node, from per-rank
rates measured on this project's 2-vCPU VM (bench/RESULTS.md, section named beside each) and
stated hardware figures. Nothing here ran on a GPU or a cluster.

    /usr/bin/python3 bench/scale_model.py [--case 1t|70b|70b-nvme|all] [--json] [overrides]
"""
import argparse
import json

# ---- Measured on this project's machine (bench/RESULTS.md); value, unit, section ----
MEASURED = {
    "adam_fp32": (1 / (2 * 0.273), "Gparam/s per core", "'CPU Adam (zinf-adam-bench)' > 'Every "
                  "optimizer, dtype combination and thread count': AdamW, 2 threads, f32 grad, "
                  "bf16 copy, 0.273 ns/elem"),
    "adam_bf16": (1 / (2 * 0.273) / 0.76, "Gparam/s per core", "'Compressed optimizer states on "
                  "the CPU (issue 17)' > 'Kernel speed': bf16 states take 0.74-0.78x fp32's "
                  "time (0.76 used)"),
    "adam_int8": (1 / (2 * 0.258), "Gparam/s per core", "'int8 states, faster on one core "
                  "(6d3049c, 434973a)': AdamW int8, 2 threads, 0.258 ns/elem"),
    "swap_read": ((8.96 + 7.56) / 2, "GB/s per process", "'NVMe swapper against fio with "
                  "huge-page buffers (issue 18)': zinf read 8M, runs 1 and 2: 8.96, 7.56"),
    "swap_write": ((8.54 + 8.08) / 2, "GB/s per process", "'NVMe swapper against fio with "
                   "huge-page buffers (issue 18)': zinf write 8M, runs 1 and 2: 8.54, 8.08"),
    "engine_vs_swapper": (0.87, "ratio", "'zinf-train: a 3.15B-parameter GPT' > 'Re-measured "
                          "22:13-22:22 UTC': engine NVMe traffic 0.84-0.90x of the swapper's own"),
    "gloo": (0.88, "GB/s per rank", "'Multi-process (issue 29)': zinf-engine-bench --nproc 2, "
             "the engine's collectives over gloo on loopback, 2 ranks on 2 vCPUs (gloo alone "
             "1.3-1.4)"),
}
FLAG_OF = {"swap_read": "nvme_read_gbps", "swap_write": "nvme_write_gbps",
           "engine_vs_swapper": "engine_vs_swapper", "gloo": "gloo_gbps"}
# Bytes the CPU Adam streams per parameter (fp32 master r+w, fp32 gradient in, states r+w,
# bf16 copy out) and bytes of master + states stored per parameter, per state dtype. RESULTS
# 'Kernel speed' counts 28 / 20 / 16.06 B with bf16 gradients; the engine's accumulators are
# fp32 (+2 B). Stored: 12 B fp32, 6.03 B int8 ('Speed: the 3.15B beyond-memory run'), 8 B bf16.
ADAM_STREAM_B = {"fp32": 30.0, "bf16": 22.0, "int8": 18.06}
STATE_B = {"fp32": 12.0, "bf16": 8.0, "int8": 6.03}

# ---- Stated hardware figures (not measured here) ----
GPU_PEAK_TFLOPS = 989.0  # H100 SXM bf16 dense (NVIDIA datasheet: 1,979 with sparsity)
COMPUTE_EFF = 0.45       # assumed fraction of peak the GPU kernels reach (40-50 %)
NVLINK_GBPS = 450.0      # NVLink 4: 900 GB/s per GPU both directions = 450 per direction
IB_GBPS = 50.0           # InfiniBand NDR 400 Gb/s per NIC, one NIC per GPU (DGX H100: 8x CX-7)
COLL_EFF = 0.80          # assumed share of link rate NCCL reaches on large messages
PCIE_GBPS = 55.0         # PCIe Gen5 x16: 64 GB/s raw per direction, ~55 effective
CPU_CORES = 112          # DGX H100: 2x Xeon Platinum 8480C, 56 cores each
ADAM_CORES = 96          # assumed: 16 cores kept for I/O threads, copies, data loading, NCCL
HOST_MEM_GBPS = 400.0    # 16 channels DDR5-4800 = 614 GB/s peak; ~65 % assumed usable
HOST_MEM_GB = 2048.0     # DGX H100: 2 TB
NVME_DRIVES = 8          # DGX H100: 8x 3.84 TB U.2 NVMe
DRIVE_READ_GBPS = 7.0    # Gen4 U.2 3.84 TB datasheet class (e.g. Samsung PM1733): 7.0 read,
DRIVE_WRITE_GBPS = 3.8   # 3.8 write, sequential; sustained writes may be lower
DRIVE_TB = 3.84

_BASE = dict(gpus=8, param_tier="cpu", seq_len=4096, micro_batch=1)
CASES = {
    "1t": dict(_BASE, title="1T parameters, 64 nodes x 8 GPUs, states on NVMe", params=1e12,
               nodes=64, state_tier="nvme", grad_accum=2),
    "70b": dict(_BASE, title="70B fine-tune, 1 node x 8 GPUs, states in CPU memory",
                params=70e9, nodes=1, state_tier="cpu", grad_accum=4),
    "70b-nvme": dict(_BASE, title="70B fine-tune, 1 node x 8 GPUs, states on NVMe",
                     params=70e9, nodes=1, state_tier="nvme", grad_accum=4),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--case", choices=list(CASES) + ["all"], default="all")
    a("--json", action="store_true", help="print one JSON object instead of Markdown")
    a("--overlap", choices=["exact", "delayed", "none"], default="exact",
      help="which step time is the prediction (all three are printed)")
    for k in ("params", "nodes", "gpus", "seq_len", "micro_batch", "grad_accum"):
        a("--" + k.replace("_", "-"), type=float if k == "params" else int,
          help="override the case's value")
    a("--tokens-per-step", type=int, help="global tokens per step; sets --grad-accum")
    for k in ("--state-tier", "--param-tier"):
        a(k, choices=["cpu", "nvme"], help="override the case's value")
    a("--state-dtype", choices=list(STATE_B), default="fp32")
    a("--rs-dtype", choices=["fp32", "bf16"], default="fp32", help="zinf sums in fp32")
    a("--pcie-grad-dtype", choices=["fp32", "bf16"], default="fp32", help="zinf's "
      "gradient_transfer_dtype")
    a("--no-checkpointing", action="store_true", help="6 instead of 8 x params x tokens")
    a("--comm", choices=["nccl", "gloo"], default="nccl")
    a("--flat-ring", action="store_true", help="every GPU's whole ring volume crosses its NIC")
    a("--adam-gparams-per-core", type=float, help="default: measured, by --state-dtype")
    for key, dest in FLAG_OF.items():
        a("--" + dest.replace("_", "-"), type=float, default=MEASURED[key][0],
          help=MEASURED[key][2])
    for flag, v in (("compute-eff", COMPUTE_EFF), ("gpu-tflops", GPU_PEAK_TFLOPS),
                    ("nvlink-gbps", NVLINK_GBPS), ("ib-gbps", IB_GBPS), ("pcie-gbps", PCIE_GBPS),
                    ("adam-cores", ADAM_CORES), ("host-mem-gbps", HOST_MEM_GBPS),
                    ("drives", NVME_DRIVES), ("drive-read-gbps", DRIVE_READ_GBPS),
                    ("drive-write-gbps", DRIVE_WRITE_GBPS)):
        a("--" + flag, type=type(v), default=v,
          help="hardware figure or assumption (default %(default)s)")
    return p.parse_args(argv)


def case_config(name, args):
    c = dict(CASES[name])
    for k in ("params", "nodes", "gpus", "seq_len", "micro_batch", "grad_accum",
              "state_tier", "param_tier"):
        if getattr(args, k) is not None:
            c[k] = getattr(args, k)
    if args.tokens_per_step:
        per_micro = c["nodes"] * c["gpus"] * c["micro_batch"] * c["seq_len"]
        c["grad_accum"] = max(1, -(-args.tokens_per_step // per_micro))
    return c


def model(c, a):
    """Rows (phase, resource, amount, unit, rate, rate unit, seconds) and the step times."""
    n, g = c["nodes"], c["gpus"]
    N, P, k = n * g, c["params"], c["grad_accum"]
    Pn, Pg = P / n, P / N                   # parameters per node (optimizer), per GPU partition
    tok_micro = c["micro_batch"] * c["seq_len"]  # per GPU per micro-step
    tokens = N * tok_micro * k
    rs_b, pcie_gb = (4 if a.rs_dtype == "fp32" else 2), (4 if a.pcie_grad_dtype == "fp32" else 2)
    sb, dt = STATE_B[a.state_dtype], a.state_dtype
    adam_rate = a.adam_gparams_per_core or MEASURED["adam_" + dt][0]
    rows = []

    def row(phase, res, amount, unit, rate, runit, sec):
        rows.append(dict(phase=phase, resource=res, amount=amount, unit=unit, rate=rate,
                         rate_unit=runit, seconds=sec))

    def gb(phase, res, nbytes, gbps):  # a row of bytes through a link of gbps GB/s
        row(phase, res, nbytes / 1e9, "GB", gbps, "GB/s", nbytes / (gbps * 1e9))

    # forward + backward phase, all k micro-steps (resources overlap through prefetch)
    flops = (6 if a.no_checkpointing else 8) * P * tok_micro * k
    rate = a.gpu_tflops * 1e12 * a.compute_eff
    row("fwd/bwd", "GPU compute, per GPU", flops / 1e15, "PFLOP", rate / 1e12, "TFLOP/s",
        flops / rate)
    S = (2 * 2 + rs_b) * P * k              # 2 all-gathers of bf16 + 1 reduce-scatter, whole model
    if a.comm == "gloo":
        gb("fwd/bwd", "collectives via gloo, per rank", (N - 1) / N * S, a.gloo_gbps)
    else:
        if n > 1:
            gb("fwd/bwd", "2 all-gathers + reduce-scatter, IB, per GPU",
               (N - 1) / N * S if a.flat_ring else (n - 1) / n * S / g, a.ib_gbps * COLL_EFF)
        gb("fwd/bwd", "2 all-gathers + reduce-scatter, NVLink, per GPU", (g - 1) / g * S,
           a.nvlink_gbps * COLL_EFF)
    h2d, d2h = 2 * Pg * 2 * k, Pg * pcie_gb * k  # partition fetched in forward and in backward
    gb("fwd/bwd", "PCIe host->GPU (parameters), per GPU", h2d, a.pcie_gbps)
    gb("fwd/bwd", "PCIe GPU->host (gradients), per GPU", d2h, a.pcie_gbps)
    nv_r = min(a.drives * a.drive_read_gbps, g * a.nvme_read_gbps) * a.engine_vs_swapper
    nv_w = min(a.drives * a.drive_write_gbps, g * a.nvme_write_gbps) * a.engine_vs_swapper
    p_rd = 2 * Pn * 2 * k if c["param_tier"] == "nvme" else 0.0
    if p_rd:
        gb("fwd/bwd", "NVMe parameter reads, per node", p_rd, nv_r)
    host_fb = g * (h2d + d2h) + (k - 1) * Pn * 12 + p_rd  # DMA + host accumulation (12 B)
    gb("fwd/bwd", "host memory (DMA, accumulation), per node", host_fb, a.host_mem_gbps)
    # optimizer phase: after the global norm (zinf's clipping waits for every gradient)
    r = a.adam_cores * adam_rate
    row("optimizer", "CPU Adam (%s states, %d cores), per node" % (dt, a.adam_cores),
        Pn / 1e9, "Gparam", r, "Gparam/s", Pn / (r * 1e9))
    st = Pn * sb if c["state_tier"] == "nvme" else 0.0   # read once and written once
    p_wr = Pn * 2 if c["param_tier"] == "nvme" else 0.0
    host_opt = Pn * ADAM_STREAM_B[dt] + 2 * st + p_wr
    gb("optimizer", "host memory (Adam %.4g B/param + NVMe DMA), per node" % ADAM_STREAM_B[dt],
       host_opt, a.host_mem_gbps)
    if st or p_wr:
        row("optimizer", "NVMe %s read + written, per node" % (
            "states (+ parameters written)" if p_wr else "states"), (2 * st + p_wr) / 1e9, "GB",
            "r %.1f / w %.1f" % (nv_r, nv_w), "GB/s",
            st / (nv_r * 1e9) + (st + p_wr) / (nv_w * 1e9))

    tops = [max((x for x in rows if x["phase"] == ph), key=lambda x: x["seconds"])
            for ph in ("fwd/bwd", "optimizer")]
    t_fb, t_op = (x["seconds"] for x in tops)
    host_both = (host_fb + host_opt) / (a.host_mem_gbps * 1e9)  # shared when phases overlap
    times = {"exact": t_fb + t_op, "delayed": max(t_fb, t_op, host_both),
             "none": sum(x["seconds"] for x in rows)}
    for x in tops:
        x["mark"] = "phase max"
    big = max(tops, key=lambda x: x["seconds"])
    big["mark"] = "**bottleneck**"
    neck = big["resource"]
    if a.overlap == "delayed" and host_both > max(t_fb, t_op):
        neck = "host memory, both phases at once"
    T = times[a.overlap]
    mfu = 6 * P * tokens / (T * N * a.gpu_tflops * 1e12)
    # capacity per node: fp32 gradient accumulators + host-tier params and states; swap + 2 %
    host_need = Pn * (4 + (2 if c["param_tier"] == "cpu" else 0) + (0 if st else sb))
    checks = {"host_memory_need_gb": host_need / 1e9, "host_memory_gb": HOST_MEM_GB,
              "nvme_need_gb": 1.02 * (st + p_wr) / 1e9,
              "nvme_capacity_gb": a.drives * DRIVE_TB * 1e3}
    return dict(config=c, gpus_total=N, tokens_per_step=tokens, rows=rows, t_fwd_bwd=t_fb,
                t_optimizer=t_op, step_time=times, predicted=a.overlap, step_s=T,
                tokens_per_s=tokens / T, mfu=mfu, bottleneck=neck, checks=checks)


def assumptions(a, inputs):
    adam, dt, ck = inputs["adam_" + a.state_dtype], a.state_dtype, not a.no_checkpointing
    return [
        "A model on paper, not a measurement: nothing here ran on a GPU or across nodes.",
        "GPU compute = %d x params x tokens per GPU (%s; attention FLOPs and embedding left out) "
        "/ (%.0f TFLOP/s bf16 dense, H100 SXM datasheet, x %.0f %% assumed efficiency). MFU "
        "counts 6 x params x tokens against the GPUs' peak over the whole step." % (
            8 if ck else 6, "checkpointing: one extra forward" if ck else "no recompute",
            a.gpu_tflops, 100 * a.compute_eff),
        "Per micro-step: all-gather of the bf16 parameters in the forward and again in the "
        "backward, reduce-scatter of %s gradients; ring volume (N-1)/N x bytes. " % a.rs_dtype
        + ("Flat ring: every GPU's whole volume crosses its NIC." if a.flat_ring else
           "Hierarchical, rail-optimised: (n-1)/n x S/g per GPU over its own NIC, (g-1)/g x S "
           "over NVLink; the levels pipeline, the slower sets the time (NCCL's multi-channel "
           "ring has the same per-NIC volume)."),
        "Links: NVLink 4 %.0f GB/s per GPU per direction, InfiniBand NDR %.0f GB/s per NIC (one "
        "per GPU), both at %.0f %% (assumed NCCL efficiency); PCIe Gen5 x16 %.0f GB/s effective "
        "per direction, full duplex, one per GPU (shared switches not modelled)." % (
            a.nvlink_gbps, a.ib_gbps, 100 * COLL_EFF, a.pcie_gbps),
        "PCIe per micro-step: each GPU fetches its bf16 partition twice (forward, backward) and "
        "sends its %s gradient partition once; the host sums micro-steps 2..k in fp32 "
        "(12 B/param)." % a.pcie_grad_dtype,
        "CPU Adam: %d of %d cores (DGX H100, 2x Xeon 8480C) at %.2f Gparam/s per core (%s). That "
        "rate had 30-60 GB/s of memory per core; a server core gets ~4 when all run, so the host "
        "memory row (%.0f GB/s: 16 ch DDR5-4800 = 614 peak, ~65 %% assumed; it also carries the "
        "PCIe and NVMe DMA) is the CPU figure to trust." % (
            a.adam_cores, CPU_CORES, adam["value"], adam["source"], a.host_mem_gbps),
        "States: fp32 master + 2 moments in %s = %.4g B/param, read and written once per step; "
        "Adam streams %.4g B/param." % (dt, STATE_B[dt], ADAM_STREAM_B[dt]),
        "NVMe per node: min(%d drives x %.1f read / %.1f write GB/s (Gen4 U.2 datasheet class), "
        "ranks x the swapper's measured %.2f / %.2f GB/s (a virtio disk the host caches: a "
        "software ceiling, not a drive figure)) x %.2f engine/swapper (measured); reads and "
        "writes share the drives (times add)." % (a.drives, a.drive_read_gbps,
                                                   a.drive_write_gbps, a.nvme_read_gbps,
                                                   a.nvme_write_gbps, a.engine_vs_swapper),
        "Overlap 'exact' (zinf's default): in fwd/bwd all resources overlap (prefetch): time = "
        "max. With gradient clipping zinf's optimizer waits for the global norm, so the "
        "optimizer phase (max of its resources; state read-ahead ignored) follows: step = sum "
        "of the two (without clipping it lies between 'exact' and 'delayed'). RESULTS 'Engine "
        "overlap' measured overlap_efficiency 0.90-1.00 on the host device, supporting max().",
        "Overlap 'delayed' (one-step delayed update): step = max of both phases and of both "
        "phases' host memory traffic. 'none': the sum of every row.",
        "Not modelled: GPU memory (activations and the gathered layer assumed to fit), the first "
        "layer's un-hidden gather, stragglers, the norm all-reduce, data loading, checksums.",
        "Gloo what-if: collectives at %.2f GB/s per rank, %s." % (
            a.gloo_gbps, inputs["gloo"]["source"]),
    ]


def markdown(name, r, a):
    def fmt(v):
        return v if isinstance(v, str) else "{:,.0f}".format(v) if v >= 100 else "%.3g" % v
    c, P, t, k = r["config"], r["config"]["params"], r["step_time"], r["checks"]
    out = ["### %s (`--case %s`): a model on paper, not a measurement\n" % (c["title"], name),
           "%d GPUs, %s parameters, seq %d x micro-batch %d x %d micro-steps = %s tokens per "
           "step; %s states on %s, bf16 parameters on %s.\n" % (
               r["gpus_total"], "%.4gT" % (P / 1e12) if P >= 1e12 else "%.4gB" % (P / 1e9),
               c["seq_len"], c["micro_batch"], c["grad_accum"], fmt(r["tokens_per_step"] * 1.0),
               a.state_dtype, c["state_tier"], c["param_tier"]),
           "| phase | resource | per step | rate | seconds | |",
           "| --- | --- | --- | --- | --- | --- |"]
    out += ["| %s | %s | %s %s | %s %s | %.2f | %s |" % (
        x["phase"], x["resource"], fmt(x["amount"]), x["unit"], fmt(x["rate"]), x["rate_unit"],
        x["seconds"], x.get("mark", "")) for x in r["rows"]]
    out.append("\n**Predicted step (%s): %.1f s, %s tokens/s, MFU %.1f %%; bottleneck: %s.** "
               "Exact update: %.1f s (fwd/bwd %.1f + optimizer %.1f); delayed update: %.1f s; "
               "no overlap: %.1f s." % (
                   r["predicted"], r["step_s"], fmt(r["tokens_per_s"]), 100 * r["mfu"],
                   r["bottleneck"], t["exact"], r["t_fwd_bwd"], r["t_optimizer"], t["delayed"],
                   t["none"]))
    out.append("Capacity per node: host memory %.0f of %.0f GB; NVMe %.0f of %.0f GB." % (
        k["host_memory_need_gb"], k["host_memory_gb"], k["nvme_need_gb"], k["nvme_capacity_gb"]))
    if "gloo_step_s" in r:
        out.append("What-if, collectives over gloo at %.2f GB/s per rank (%s): step %.1f s." % (
            a.gloo_gbps, "measured on loopback" if a.gloo_gbps == MEASURED["gloo"][0] else
            "--gloo-gbps", r["gloo_step_s"]))
    return "\n".join(out) + "\n"


def measured_inputs(a):
    """The measured figures in use, each with its RESULTS section (or the flag overriding it)."""
    inputs = {}
    for key, (v, unit, src) in MEASURED.items():
        flag = FLAG_OF.get(key, "adam_gparams_per_core")
        if key.startswith("adam_") and key != "adam_" + a.state_dtype:
            continue
        used = getattr(a, flag) or v
        src = ("--" + flag.replace("_", "-") if used != v else
               src if src.startswith("PLACEHOLDER") else "bench/RESULTS.md " + src)
        inputs[key] = dict(value=used, unit=unit, source=src)
    return inputs


def main(argv=None):
    a = parse_args(argv)
    names = list(CASES) if a.case == "all" else [a.case]
    results, inputs = {}, measured_inputs(a)
    for nm in names:
        c = case_config(nm, a)
        results[nm] = model(c, a)
        if a.comm == "nccl":
            alt = argparse.Namespace(**dict(vars(a), comm="gloo"))
            results[nm]["gloo_step_s"] = model(c, alt)["step_s"]
    if a.json:
        print(json.dumps(dict(kind="model on paper, not a measurement", inputs=inputs,
                              args=vars(a), assumptions=assumptions(a, inputs),
                              cases=results), indent=1))
        return
    print("## Scale model (bench/scale_model.py): predictions on paper, not measurements\n")
    for nm in names:
        print(markdown(nm, results[nm], a))
    print("Inputs measured on this project's 2-vCPU VM (bench/RESULTS.md):\n")
    print("\n".join("- %s = %.3g %s: %s" % (k, v["value"], v["unit"], v["source"])
                    for k, v in inputs.items()))
    print("\nAssumptions:\n\n" + "\n".join("- " + x for x in assumptions(a, inputs)))


if __name__ == "__main__":
    main()
