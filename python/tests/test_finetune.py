"""python/examples/finetune.py as a user runs it: a Hugging Face folder's config.json decides the
model (sizes, vocabulary, rope_theta, rms_norm_eps): the first loss equals torch's on the same
model and batch (to 1e-5 relative: the same fp32 forward, summed in another order), which a
model built with the defaults (rope_theta 10000, eps 1e-6) does not reach; a tensor the model
does not use is named; the pinned budget is sized to the model; under zinf.launch with two
ranks one report is printed."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from st_writer import write_file
from zinf.models import Llama

ROOT = os.environ.get("ZINF_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "python", "examples", "finetune.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import finetune  # noqa: E402

HF = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
      "vocab_size": 256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
      "tie_word_embeddings": False}


def hf_folder(folder):
    torch.manual_seed(7)
    model = Llama(vocab=256, dim=32, layers=2, n_heads=4, n_kv_heads=2, hidden=64, max_seq=16,
                  rope_theta=500000.0, eps=1e-5)
    tensors = {("model." + n if not n.startswith("lm_head") else n): p.detach().clone()
               for n, p in model.named_parameters()}
    # Hugging Face's older checkpoints hold the rotary frequencies too.
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    os.makedirs(folder)
    write_file(os.path.join(folder, "model.safetensors"), tensors)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(HF, f)
    return model


def run(cmd, cwd, timeout=300):
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError("timed out: %s" % err.decode(errors="replace")[-3000:])
    out, err = out.decode(errors="replace"), err.decode(errors="replace")
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    return out, err


def test_a_hugging_face_folder_decides_the_model(scratch):
    folder = os.path.join(scratch, "hf")
    model = hf_folder(folder)
    out, _ = run([sys.executable, SCRIPT, "--load", folder, "--steps", "1", "--lr", "0",
                  "--seq", "16", "--batch", "2", "--param-tier", "cpu", "--optimizer-tier",
                  "cpu", "--fp32", "--device", "cpu"], scratch)
    assert "finetune: Llama 2 layers, dim 32, 4/2 heads, MLP 64, vocabulary 256" in out
    assert "not used (no such tensor in this model): " \
           "model.layers.0.self_attn.rotary_emb.inv_freq" in out
    summary = json.loads(out.strip().splitlines()[-1])
    data = finetune.Batches(os.path.join(ROOT, "train", "data", "corpus.txt"), 16, 2, 0)
    x, y = data.get(0, 0, 0)
    with torch.no_grad():
        want = model(x, y).item()
        torch.manual_seed(7)
        plain = Llama(vocab=256, dim=32, layers=2, n_heads=4, n_kv_heads=2, hidden=64,
                      max_seq=16)
        plain.load_state_dict(model.state_dict())
        default = plain(x, y).item()
    assert summary["loss_first"] == pytest.approx(want, rel=1e-5)
    # The config's values matter here: the defaults miss by 10x the tolerance and more.
    assert abs(default - want) > 1e-4 * abs(want)
    assert summary["pinned_budget_bytes"] == 128 << 20


def test_a_flag_that_contradicts_config_json_is_refused(scratch):
    folder = os.path.join(scratch, "hf")
    hf_folder(folder)
    p = subprocess.run([sys.executable, SCRIPT, "--load", folder, "--dim", "64"],
                       cwd=scratch, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--dim 64, but" in p.stderr and "config.json says 32" in \
        p.stderr, p.stderr


def test_under_a_launcher_rank_zero_reports_once(scratch):
    out, _ = run([sys.executable, "-m", "zinf.launch", "--nproc_per_node", "2", SCRIPT,
                  "--steps", "2", "--seq", "16", "--batch", "2", "--param-tier", "cpu",
                  "--optimizer-tier", "cpu", "--layers", "1", "--dim", "32", "--heads", "4",
                  "--device", "cpu"], scratch)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1 and lines[0]["world_size"] == 2 and lines[0]["steps"] == 2
    assert out.count("finetune: Llama") == 1


def test_layer_major_over_two_ranks_trains_the_micro_batch_schedules_losses(scratch):
    """--grad-accum 3 with LoRA under a launcher: the default schedule (auto: layer-major, the
    parameters offloaded) gives the micro-batch schedule's losses, bit for bit."""
    summaries = {}
    for schedule in ("auto", "micro-batch"):
        out, _ = run([sys.executable, "-m", "zinf.launch", "--nproc_per_node", "2", SCRIPT,
                      "--steps", "3", "--seq", "16", "--batch", "1", "--grad-accum", "3",
                      "--param-tier", "cpu", "--optimizer-tier", "cpu", "--layers", "2",
                      "--dim", "32", "--heads", "4", "--lora", "4", "--lr", "3e-3",
                      "--device", "cpu", "--schedule", schedule,
                      "--nvme", os.path.join(scratch, schedule)], scratch)
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert len(lines) == 1
        summaries[schedule] = lines[0]
    assert summaries["auto"]["schedule"] == "layer-major"
    assert summaries["micro-batch"]["schedule"] == "micro-batch"
    assert summaries["auto"]["losses"] == summaries["micro-batch"]["losses"]
    assert summaries["auto"]["losses"][-1] != summaries["auto"]["losses"][0]
