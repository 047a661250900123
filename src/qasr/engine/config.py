"""What an engine is asked to be (EngineConfig) and what it reports (EngineStats): plain data."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

QUANTIZE_MODES = ("int8", "int4")
QUANTIZE_CHOICES = ("none", *QUANTIZE_MODES)  # a command line's --quantize
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class EngineConfig:
    """How an engine runs (docs/engine.md)."""

    kv_cache_bytes: int | None = None  # None or 0: on CPU two fifths of the available memory, at most 8 GiB
    kv_block_tokens: int = 64  # the KV pool's unit
    # features and encoder rows of admitted requests; None or 0: on CPU a tenth of the available memory, at
    # most 2 GiB (admission waits while more would be held; an engine with nothing admitted admits one)
    audio_memory_bytes: int | None = None
    max_running: int = 64
    # one budget per step: decode rows (drafts' included) + prompt tokens (whole chunks) + encoder rows (whole 8 s
    # windows); every decode row runs, and a step with encoder or prefill work moves a window and a chunk at least
    step_tokens: int = 1024
    prefill_chunk: int = 256  # every prompt's chunk grid (keeps outputs batch-independent)
    conv_batch: int = 8  # 1 s chunks per conv call
    native_kernels: bool = True  # qasr's C++ CPU kernels (else torch ops)
    backend: str = "auto"  # engine/device.py; auto: the model's device type
    cuda_graphs: bool = True  # CUDA: replay decode steps as graphs
    quantize: str | None = None  # None: the checkpoint's dtype; "int8" / "int4": CPU only (docs/quantization.md)
    drafts: bool = True  # check guessed tokens (Continuation.draft) where that is exact
    kv_cache_dtype: str = "auto"  # "int8": about half the bytes (CPU only)
    threads: int | None = None  # torch/OpenMP threads; None: torch's count, at most the usable CPUs (cpu/openmp.py)

    def __post_init__(self) -> None:
        """Refuse settings with which the engine could not make progress."""
        for name in ("kv_block_tokens", "max_running", "step_tokens", "prefill_chunk", "conv_batch", "threads"):
            value = getattr(self, name)
            if name == "threads" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if self.quantize is not None and self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"EngineConfig.quantize must be None (off) or one of {', '.join(QUANTIZE_MODES)}, "
                             f"got {self.quantize!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"EngineConfig.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        for name in ("kv_cache_bytes", "audio_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, Integral) or value < 0):
                raise ValueError(f"EngineConfig.{name} must be None (or 0: the default size) or a positive byte "
                                 f"count, got {value!r}")
        # a request's encoder runs ahead of its prefill while less than step_tokens ahead (Scheduler._wants_slice)
        if self.prefill_chunk > self.step_tokens:
            raise ValueError(f"EngineConfig.prefill_chunk ({self.prefill_chunk}) must be at most step_tokens "
                             f"({self.step_tokens}): a longer chunk can wait forever for audio the encoder does "
                             "not run ahead to")


@dataclass(frozen=True)
class EngineStats:
    waiting: int  # submitted (or preempted), not yet admitted
    running: int
    kv_tokens_used: int  # blocks in use (leases included) x block size
    kv_tokens_total: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_block_tokens: int
    preemptions: int
    steps: int
    generated_tokens: int
    tokens_per_s: float  # over the last RATE_WINDOW_S seconds
    broken: bool
    closed: bool
    kv_cache_bytes: int = 0
    stalled_s: float = 0.0  # seconds with work in hand since the last step ended; 0 when idle


def quantize_option(value: str | None) -> str | None:
    """A front end's quantize setting (None, "none" or a mode) as EngineConfig takes it."""
    if value is None or value == "none":
        return None
    if value not in QUANTIZE_MODES:
        raise ValueError(f"unknown quantize mode {value!r}; use none or {', '.join(QUANTIZE_MODES)}")
    return value
