"""Varlen attention over the token-major KV pool: torch's flash kernel on CUDA, a portable reference
everywhere else (and on CUDA where flash cannot run: float32, or a torch without it).

Both take packed queries ``q`` (N, heads, head_dim), one layer's pool slabs ``kc`` / ``vc`` (tokens + 1,
kv_heads, head_dim) with this forward's new keys and values already stored, and a ``VarlenMeta``; both
return (N, heads * head_dim). The flash call reads each sequence's keys in place (``cu_seqlens_k`` = region
starts, ``seqused_k`` = lengths: see plan.py); the reference gathers a padded batch and runs one masked
SDPA. At first use on a device the flash path is checked against the reference (``self_test``) and steps
aside with a warning if it fails, like the CPU kernels do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from qasr.engine.cuda.fallback import fallback_attention
from qasr.engine.cuda.plan import VarlenMeta, upload_meta

log = logging.getLogger(__name__)
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, VarlenMeta, float], torch.Tensor]


def reference_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: VarlenMeta,
                        scale: float) -> torch.Tensor:
    """The portable attention over the token-major slabs: padded SDPA in groups by request kind
    (cuda/fallback.py), so its memory stays bounded at any concurrency."""
    return fallback_attention(q, kc, vc, meta.fallback, scale)


def flash_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: VarlenMeta,
                    scale: float) -> torch.Tensor:
    """torch's flash varlen forward (fp16 / bf16 on CUDA), causal at the bottom right, no gather."""
    out = torch.ops.aten._flash_attention_forward(
        q, kc, vc, meta.cu_q, meta.k_starts, meta.max_q, meta.max_k, 0.0, True, False,
        scale=scale, seqused_k=meta.used_k)[0]
    return out.reshape(q.shape[0], -1)


# what flash_attention passes: these ten arguments by position, then these by keyword (torch >= 2.5 has them)
FLASH_POSITIONAL = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
                    "return_debug_mask")
FLASH_KEYWORDS = ("scale", "seqused_k")
_warned: set[str] = set()


def _flash_schema() -> object | None:
    """The installed torch's schema of aten._flash_attention_forward (None without the op)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return None if op is None else op.default._schema


def flash_schema_problem(schema: object | None) -> str | None:
    """None when ``schema`` (a torch FunctionSchema) takes the call flash_attention makes, else what differs."""
    if schema is None:
        return "this torch has no aten._flash_attention_forward"
    args = list(schema.arguments)
    positional = [a.name for a in args if not a.kwarg_only]
    keywords = {a.name for a in args if a.kwarg_only}
    if tuple(positional[:len(FLASH_POSITIONAL)]) != FLASH_POSITIONAL:
        return f"aten._flash_attention_forward takes ({', '.join(positional)}), not ({', '.join(FLASH_POSITIONAL)})"
    missing = [k for k in FLASH_KEYWORDS if k not in keywords]
    if missing:
        return f"aten._flash_attention_forward has no {', '.join(missing)} argument (torch {torch.__version__})"
    required = [a.name for a in args[len(FLASH_POSITIONAL):] if not a.has_default_value()]
    if required:
        return f"aten._flash_attention_forward requires {', '.join(required)}, which qasr does not pass"
    return None


def flash_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when the flash path may be tried here, else why not. A torch whose flash op takes other
    arguments than the call flash_attention makes is reported with one warning (the portable attention
    then runs, correct but slower)."""
    if device.type != "cuda":
        return "not a CUDA device"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash attention takes float16 / bfloat16, the model runs in {dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim} is not a multiple of 8 up to 256"
    why = flash_schema_problem(_flash_schema())
    if why is not None and why not in _warned:
        _warned.add(why)
        log.warning("qasr: %s; using the portable attention", why)
    return why


def self_test(attention: Attention, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
              head_dim: int, seed: int = 0) -> str | None:
    """Run ``attention`` on a mixed batch (decode rows, a prefill chunk with a cached prefix, a fresh
    prompt, regions out of order with gaps and NaN between them) against the reference in float32.
    None when it agrees (relative error under 2e-2 for 16-bit types, 1e-4 for float32), else why not."""
    gen = torch.Generator().manual_seed(seed)
    tokens = 700
    kc = torch.full((tokens + 1, kv_heads, head_dim), float("nan"))
    vc = torch.full((tokens + 1, kv_heads, head_dim), float("nan"))
    starts, qlens, ctxs = [400, 10, 150, 600], [1, 1, 37, 64], [70, 5, 120, 0]
    for s, q_n, c in zip(starts, qlens, ctxs, strict=True):  # every key the sequences read, written
        kc[s:s + c + q_n] = torch.randn(c + q_n, kv_heads, head_dim, generator=gen)
        vc[s:s + c + q_n] = torch.randn(c + q_n, kv_heads, head_dim, generator=gen)
    q = torch.randn(sum(qlens), heads, head_dim, generator=gen)
    scale = head_dim ** -0.5

    def meta_on(dev: torch.device) -> VarlenMeta:
        return upload_meta(starts, qlens, ctxs, 2, dev)[0]

    want = reference_attention(q, kc, vc, meta_on(torch.device("cpu")), scale)
    try:
        got = attention(q.to(device, dtype), kc.to(device, dtype), vc.to(device, dtype), meta_on(device), scale)
        got = got.float().cpu()
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use this kernel here
        return f"raised {exc!r}"
    if got.shape != want.shape:
        return f"gave shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not torch.isfinite(got).all():
        return "gave non-finite values"
    err = ((got - want).norm() / want.norm()).item()
    limit = 1e-4 if dtype == torch.float32 else 2e-2
    return None if err < limit else f"relative error {err:.2e} against the float32 reference (limit {limit:g})"


def choose_attention(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                     head_dim: int) -> tuple[Attention, str]:
    """The flash path where it is supported and passes its self-test here, else the reference."""
    why = flash_supported(device, dtype, head_dim)
    if why is None:
        why = self_test(flash_attention, device, dtype, heads, kv_heads, head_dim)
        if why is None:
            return flash_attention, "flash varlen attention (torch, in place over the pool)"
        log.warning("qasr: flash varlen attention failed its self-test (%s); using the portable attention", why)
    return reference_attention, f"portable padded attention ({why})"
