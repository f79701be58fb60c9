"""`pip install ./python` works offline into a fresh virtual environment (with the system's
torch), and the installed package trains (not the build tree's copy)."""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.environ.get("ZINF_SOURCE_DIR",
                      os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_pip_install_offline_into_a_venv(scratch):
    venv = os.path.join(scratch, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if "ZINF_BUILD_DIR" not in env:
        pytest.skip("ZINF_BUILD_DIR unset: run through ctest (a fresh build takes minutes)")
    pip = subprocess.run([os.path.join(venv, "bin", "pip"), "install", "--no-index",
                          "--no-cache-dir", os.path.join(ROOT, "python")],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=900)
    assert pip.returncode == 0, pip.stdout
    script = textwrap.dedent("""
        import torch, zinf
        assert zinf.__file__.startswith(%r), zinf.__file__
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        engine = zinf.initialize(model, {"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
        x = torch.randn(16, 8)
        first = None
        for _ in range(20):
            loss = (engine(x) - 1).pow(2).mean()
            engine.backward(loss)
            engine.step()
            first = first or loss.item()
        print(first, loss.item())
        assert loss.item() < first / 2
    """ % venv)
    run = subprocess.run([os.path.join(venv, "bin", "python"), "-c", script], env=env,
                         cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout
