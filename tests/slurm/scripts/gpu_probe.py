"""Run as every rank of a job: print, as one JSON line, where this rank runs and which GPU it would use."""

import json
import os

from hpctrain.base.rankenv import read_env, select_device

env = read_env()
visible = [d for d in (env.cuda_visible_devices or "").split(",") if d]
try:
    device = select_device(env, len(visible))
except Exception as exc:  # noqa: BLE001 - the test reads the error
    device = f"error: {exc}"
print(json.dumps({"rank": env.rank, "local_rank": env.local_rank, "node": env.node_name,
                  "cuda_visible_devices": env.cuda_visible_devices, "device": device,
                  "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
                  "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "threads": env.torch_threads(),
                  "probe_env": os.environ.get("HPCTRAIN_PROBE")}), flush=True)
