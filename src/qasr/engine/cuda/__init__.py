"""The CUDA backend; its flash and graph paths run only on a GPU (scripts/gpu_check.sh)."""
