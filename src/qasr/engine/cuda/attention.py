"""Varlen attention over the token-major KV pool: torch's flash kernel on CUDA where it passes its
self-test, else the portable reference. Both map q (N, heads, hd) and one layer's slabs kc / vc (tokens + 1,
kv_heads, hd), new keys stored, to (N, heads * hd).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from qasr.engine.cuda.fallback import fallback_attention
from qasr.engine.cuda.plan import VarlenMeta, upload_meta
from qasr.engine.kv_blocks import token_rows

log = logging.getLogger(__name__)
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, VarlenMeta, float], torch.Tensor]


def reference_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: VarlenMeta,
                        scale: float) -> torch.Tensor:
    """Padded SDPA in bounded groups (cuda/fallback.py)."""
    return fallback_attention(q, kc, vc, meta.fallback, scale)


def staged(kc: torch.Tensor, vc: torch.Tensor, meta: VarlenMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool slabs, or the keys ``meta.gather`` names."""
    if meta.gather is None:
        return kc, vc
    return kc.index_select(0, meta.gather), vc.index_select(0, meta.gather)


def flash_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: VarlenMeta,
                    scale: float) -> torch.Tensor:
    """torch's flash varlen forward (fp16 / bf16), causal at the bottom right."""
    kc, vc = staged(kc, vc, meta)
    out = torch.ops.aten._flash_attention_forward(
        q, kc, vc, meta.cu_q, meta.k_starts, meta.max_q, meta.max_k, 0.0, True, False,
        scale=scale, seqused_k=meta.used_k)[0]
    return out.reshape(q.shape[0], -1)


# the call flash_attention makes: these arguments by position, then these by keyword
FLASH_POSITIONAL = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
                    "return_debug_mask")
FLASH_KEYWORDS = ("scale", "seqused_k")
_warned: set[str] = set()


def _flash_schema() -> object | None:
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return None if op is None else op.default._schema


def flash_schema_problem(schema: object | None) -> str | None:
    """None when ``schema`` takes the call flash_attention makes, else what differs."""
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
    """None when the flash path may be tried here, else why not (an unexpected op schema warns once)."""
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
    """None when ``attention`` agrees with the float32 reference on a mixed batch, with consecutive and
    with scattered blocks (NaN in every row no sequence owns), else why not."""
    gen = torch.Generator().manual_seed(seed)
    bs, blocks = 16, 44
    qlens, ctxs = [1, 1, 37, 64], [70, 5, 120, 0]
    need = [-(-(c + n) // bs) for n, c in zip(qlens, ctxs, strict=True)]
    order = torch.randperm(blocks, generator=gen).tolist()
    firsts = [25, 2, 10, 40]
    layouts = ([list(range(f, f + k)) for f, k in zip(firsts, need, strict=True)],
               [order[sum(need[:b]):sum(need[:b + 1])] for b in range(len(need))])
    scale = head_dim ** -0.5
    for tables in layouts:
        kc = torch.full((blocks * bs + 1, kv_heads, head_dim), float("nan"))
        vc = torch.full((blocks * bs + 1, kv_heads, head_dim), float("nan"))
        for t, n, c in zip(tables, qlens, ctxs, strict=True):
            rows = torch.from_numpy(token_rows(t, bs, 0, c + n))
            kc[rows] = torch.randn(c + n, kv_heads, head_dim, generator=gen)
            vc[rows] = torch.randn(c + n, kv_heads, head_dim, generator=gen)
        q = torch.randn(sum(qlens), heads, head_dim, generator=gen)

        def meta_on(dev: torch.device, tables: list[list[int]] = tables) -> VarlenMeta:
            return upload_meta(tables, bs, qlens, ctxs, 2, dev)[0]

        want = reference_attention(q, kc, vc, meta_on(torch.device("cpu")), scale)
        try:
            got = attention(q.to(device, dtype), kc.to(device, dtype), vc.to(device, dtype), meta_on(device), scale)
            got = got.float().cpu()
        except Exception as exc:  # noqa: BLE001
            return f"raised {exc!r}"
        if got.shape != want.shape:
            return f"gave shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        if not torch.isfinite(got).all():
            return "gave non-finite values"
        err = ((got - want).norm() / want.norm()).item()
        limit = 1e-4 if dtype == torch.float32 else 2e-2
        if err >= limit:
            return f"relative error {err:.2e} against the float32 reference (limit {limit:g})"
    return None


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
