"""What an engine is asked to be (EngineConfig) and what it reports (EngineStats): plain data, shared by
the engine, its device backends and the front ends without importing the engine itself."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

QUANTIZE_MODES = ("int8", "int4")  # EngineConfig.quantize: None (off) or one of these (docs/quantization.md)
QUANTIZE_CHOICES = ("none", *QUANTIZE_MODES)  # a command line's --quantize: none is off
KV_CACHE_DTYPES = ("auto", "int8")  # EngineConfig.kv_cache_dtype: auto = the model's dtype (engine/kv_quant.py)


@dataclass(frozen=True)
class EngineConfig:
    kv_cache_bytes: int | None = None  # None (or 0): 40% of available memory on CPU, capped at 8 GiB
    kv_block_tokens: int = 64  # the KV pool is handed out in blocks of this many tokens (docs/engine.md: why 64)
    max_running: int = 64
    prefill_tokens: int = 512  # prompt tokens per step (whole chunks), riding along with the decode rows
    prefill_chunk: int = 256  # the fixed chunk grid of every prompt (keeps outputs batch-independent)
    encoder_tokens: int = 512  # encoder output tokens per step (whole 8 s windows; less than one window means one)
    conv_batch: int = 8  # 1 s chunks per conv call: small groups keep the activations in cache
    native_kernels: bool = True  # qasr's C++ CPU kernels (each self-tested; torch ops where they fail)
    backend: str = "auto"  # the device backend (engine/device.py): auto = the model's device type
    cuda_graphs: bool = True  # CUDA backend: replay pure decode steps as graphs per batch bucket
    # None: the checkpoint's dtype; "int8": int8 weights and per-row int8 activations in every linear and the
    # encoder's 480-channel convolutions; "int4": the same, with int4 weights (groups of 128) in the decoder's
    # linears and LM head (CPU backend only; engine/cpu/int8.py, int4.py, docs/quantization.md)
    quantize: str | None = None
    # While live (interactive) work is in the engine, the share of engine time that steps carrying batch work's
    # encoder windows and prefill chunks may take (1.0: no limit). Live captions wait for a dozen steps each;
    # batch decode rows still run in every step. docs/engine.md: the measurement behind the default.
    live_batch_share: float = 0.25
    # check the tokens a request guesses it will make (submit's draft: a live step's rolled-back tokens) in decode
    # rows beside its own, where the kernels make that exact (Engine.verifies_drafts); False: drafts are ignored
    drafts: bool = True
    # "auto": the KV cache holds keys and values in the model's dtype; "int8": int8 with a float32 scale per token
    # and kv head, about half the bytes (twice the tokens in the same kv_cache_bytes, half the cache reads per
    # decode step) for a small accuracy cost (CPU backend only; engine/kv_quant.py, docs/engine.md)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        """Refuse settings with which the engine could not make progress (it would spin empty steps)."""
        for name in ("kv_block_tokens", "max_running", "prefill_tokens", "prefill_chunk", "encoder_tokens",
                     "conv_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if self.quantize is not None and self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"EngineConfig.quantize must be None (off) or one of {', '.join(QUANTIZE_MODES)}, "
                             f"got {self.quantize!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"EngineConfig.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        share = self.live_batch_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"EngineConfig.live_batch_share must be in (0, 1], got {share!r}: at 0 batch work would "
                             "never advance while live sessions run")
        kv = self.kv_cache_bytes
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, Integral) or kv < 0):
            raise ValueError(f"EngineConfig.kv_cache_bytes must be None (or 0: the default size) or a positive byte "
                             f"count, got {kv!r}")
        # The encoder runs ahead of prefill by at most 2 * prefill_tokens audio tokens (scheduler._plan_encode),
        # and a prefill chunk waits until all its audio is encoded: a chunk longer than that lookahead can
        # need audio the encoder will never run ahead to, and every step is empty from then on.
        if self.prefill_chunk > 2 * self.prefill_tokens:
            raise ValueError(f"EngineConfig.prefill_chunk ({self.prefill_chunk}) must be at most 2 * prefill_tokens "
                             f"({2 * self.prefill_tokens}): a longer chunk can wait forever for audio the encoder "
                             "does not run ahead to")


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
    kv_cache_bytes: int = 0  # the KV pool's memory (int8 keys and values with their scales, or the model's dtype)


def quantize_option(value: str | None) -> str | None:
    """A front end's quantize setting (``None``, ``"none"`` or a mode) as EngineConfig takes it (None or a
    mode); anything else is a ValueError naming the choices."""
    if value is None or value == "none":
        return None
    if value not in QUANTIZE_MODES:
        raise ValueError(f"unknown quantize mode {value!r}; use none or {', '.join(QUANTIZE_MODES)}")
    return value
