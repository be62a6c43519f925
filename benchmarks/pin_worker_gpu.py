"""A pytest plugin that gives each pytest-xdist worker one GPU of the machine, round robin, before jax starts.

Loaded by ``gpu_suite.py --gpus 0,1`` (``-p pin_worker_gpu`` with ``JKV_SUITE_GPUS=0,1``): worker gwN sees only GPU
N mod 2 (``CUDA_VISIBLE_DEVICES``), so each test runs on one GPU as on a single-GPU machine, and the workers share
the machine's GPUs instead of all landing on the first. Outside a worker (no ``PYTEST_XDIST_WORKER``) it does nothing.
"""

import os

_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
_gpus = [g for g in os.environ.get("JKV_SUITE_GPUS", "").split(",") if g]
if _worker.startswith("gw") and _gpus:
  os.environ["CUDA_VISIBLE_DEVICES"] = _gpus[int(_worker[2:]) % len(_gpus)]
