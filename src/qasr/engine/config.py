"""What an engine is asked to be (EngineConfig) and what it reports (EngineStats): plain data, shared by
the engine, its device backends and the front ends without importing the engine itself."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    kv_cache_bytes: int | None = None  # None: 40% of available memory on CPU, capped at 8 GiB
    kv_block_tokens: int = 16  # the KV pool is handed out in blocks of this many tokens (docs/engine.md: why 16)
    max_running: int = 64
    prefill_tokens: int = 512  # prompt tokens per step (whole chunks), riding along with the decode rows
    prefill_chunk: int = 256  # the fixed chunk grid of every prompt (keeps outputs batch-independent)
    encoder_tokens: int = 512  # encoder output tokens per step (whole 8 s windows, at least one)
    conv_batch: int = 8  # 1 s chunks per conv call: small groups keep the activations in cache
    native_kernels: bool = True  # qasr's C++ CPU kernels (each self-tested; torch ops where they fail)
    backend: str = "auto"  # the device backend (engine/device.py): auto = the model's device type
    cuda_graphs: bool = True  # CUDA backend: replay pure decode steps as graphs per batch bucket


@dataclass(frozen=True)
class EngineStats:
    waiting: int  # submitted (or preempted), not yet admitted
    running: int  # admitted: encoding, prefilling or decoding
    kv_tokens_used: int  # tokens of KV memory held: blocks in use (running requests and kept leases) x block size
    kv_tokens_total: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_block_tokens: int
    preemptions: int  # requests preempted (blocks freed, recomputed later) since start
    steps: int
    generated_tokens: int
    tokens_per_s: float  # generated tokens per second over the last RATE_WINDOW_S seconds
    broken: bool
    closed: bool
