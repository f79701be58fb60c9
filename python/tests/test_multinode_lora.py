"""ZeRO++ across two "nodes" with a LoRA fine-tune (issue 42): python/examples/finetune.py on
2 network namespaces x 2 ranks joined by a veth pair (bench/zeropp_link.sh, root only), the
base frozen and stored as int8, with qwZ, hpZ (the nodes) and two-hop qgZ together, on CPU and
on NVMe offload, against plain ZeRO-3 with the base as it is (bf16).

The int8 base is gathered in its stored form across the nodes in the forward only (hpZ keeps
the node's shard for the backward) and the adapters' gradients cross as int8 blocks, so node B's
veth carries about a quarter of plain ZeRO-3's bytes (0.25-0.27x measured; the issue's bound is
0.35x). The losses stay within 2 % of plain's (the int8 base is the largest difference: about
3e-4 of the loss).
"""
import json
import os
import subprocess

import pytest

SOURCE = os.environ.get("ZINF_SOURCE_DIR",
                        os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
EVERY_USE = {"stage": 3, "stage3_param_persistence_threshold": 0,
             "stage3_max_reuse_distance": 0}
STEPS = 5


def run_cases(tmp_path, cases):
    """bench/zeropp_link.sh over the cases ("MBIT FLAGS"); their JSON lines, in order."""
    script = os.path.join(SOURCE, "bench", "zeropp_link.sh")
    finetune = os.path.join(SOURCE, "python", "examples", "finetune.py")
    corpus = os.path.join(SOURCE, "train", "data", "corpus.txt")
    env = dict(os.environ, ZINF_TEST_DIR=str(tmp_path))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(["bash", script, finetune, corpus, str(STEPS)] + cases, env=env,
                       capture_output=True, text=True, timeout=800)
    if p.returncode == 77:
        pytest.skip("network namespaces: " + p.stdout.strip())
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == len(cases), p.stdout
    return lines


def test_lora_with_an_int8_base_and_all_three_modes_across_two_nodes(tmp_path):
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"zero_optimization": EVERY_USE}))
    zeropp = tmp_path / "zeropp.json"
    zeropp.write_text(json.dumps({"zero_optimization": dict(
        EVERY_USE, zero_quantized_weights=True, zero_quantized_gradients=True,
        zero_hpz_partition_size=2)}))
    lora = "--preset small --lora 16 --warmup 1"
    cpu = "--param-tier cpu --optimizer-tier cpu"
    nvme = "--param-tier nvme --optimizer-tier nvme"
    # An unlimited link: the bytes are the figure here, not the time.
    runs = run_cases(tmp_path, [
        "10000 %s --config %s %s" % (lora, plain, cpu),
        "10000 %s --frozen-weight-dtype int8 --config %s %s" % (lora, zeropp, cpu),
        "10000 %s --frozen-weight-dtype int8 --config %s %s" % (lora, zeropp, nvme),
    ])
    base, on_cpu, on_nvme = runs
    assert base["frozen_weight_dtype"] == "as-is", base
    for run in (on_cpu, on_nvme):
        assert run["frozen_weight_dtype"] == "int8", run
        assert len(run["losses"]) == STEPS, run
        ratio = run["link_bytes_per_step"] / base["link_bytes_per_step"]
        assert ratio <= 0.35, (ratio, run["flags"])
        worst = max(abs(a - b) / b for a, b in zip(run["losses"], base["losses"]))
        assert worst < 0.02, (worst, run["losses"], base["losses"])
    # The tiers store what they are given: the same losses from CPU and NVMe offload.
    assert on_cpu["losses"] == on_nvme["losses"]
