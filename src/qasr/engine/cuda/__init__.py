"""The CUDA backend (chosen in engine/device.py): plan.py (varlen metadata, decode buckets, pinned uploads),
attention.py (flash varlen over the pool, portable reference, self-test), kv_cache.py (token-major pool),
graphs.py (decode steps captured per batch bucket), runner.py (one upload per dtype and one host sync per
step, features on the device), prepare.py. Its planning runs on CPU tensors in the tests; the flash and
graph paths run only on a GPU (scripts/gpu_check.sh)."""
