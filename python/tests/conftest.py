"""Shared fixtures: a scratch folder on disk (the NVMe tier's swap files go there) and configs.

A test file whose tests were all skipped ends with exit status 77, which ctest reports as
"Skipped" (SKIP_RETURN_CODE), so a skipped GPU test never reads as passed.
"""
import gc
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

_counts = {"passed": 0, "failed": 0, "skipped": 0}


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _counts[report.outcome] = _counts.get(report.outcome, 0) + 1


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 0 and _counts["skipped"] > 0 and _counts["passed"] == 0:
        session.exitstatus = 77


@pytest.fixture
def scratch():
    root = os.environ.get("ZINF_TEST_DIR", "/var/tmp")
    path = tempfile.mkdtemp(prefix="zinf-pytest-", dir=root)
    yield path
    gc.collect()  # engines a failed test left behind close their swap files first
    shutil.rmtree(path, ignore_errors=True)


def make_config(param="cpu", states="cpu", nvme=None, lr=1e-3, weight_decay=0.01, gas=1,
                clip=0.0, bf16=False, **zinf_keys):
    """A DeepSpeed-style config dict (parameters and states on the given tiers)."""
    offload_param = {"device": param}
    offload_optimizer = {"device": states}
    if param == "nvme":
        offload_param["nvme_path"] = nvme
    if states == "nvme":
        offload_optimizer["nvme_path"] = nvme
    cfg = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": offload_param,
            "offload_optimizer": offload_optimizer,
            "sub_group_size": 20000,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
        },
        "optimizer": {"type": "AdamW",
                      "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                 "weight_decay": weight_decay}},
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "bf16": {"enabled": bf16},
        "zinf": dict({"pinned_budget_bytes": "64M", "optimizer_threads": 1}, **zinf_keys),
    }
    return cfg
