"""Varlen attention over the paged KV pool: torch's flash kernel on CUDA, reading each sequence's keys through
its block table, where it passes its self-test, else the portable reference. Both map q (N, heads, hd) and one
layer's pool kc / vc (blocks + 1, block_size, kv_heads, hd), new keys stored, to (N, heads * hd).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from qasr.engine.cuda.fallback import fallback_attention
from qasr.engine.cuda.plan import FLASH_BLOCK_TOKENS, PinnedStaging, VarlenMeta, upload_meta
from qasr.engine.kv_blocks import token_rows

log = logging.getLogger(__name__)
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, VarlenMeta, float], torch.Tensor]


def rows_of(pool: torch.Tensor) -> torch.Tensor:
    """A layer's paged pool (blocks, block_size, kv_heads, hd) as token rows (blocks * block_size, kv_heads, hd)."""
    return pool.reshape(-1, *pool.shape[-2:])


def reference_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: VarlenMeta,
                        scale: float) -> torch.Tensor:
    """Padded SDPA in bounded groups (cuda/fallback.py)."""
    return fallback_attention(q, rows_of(kc), rows_of(vc), meta.fallback, scale)


def flash_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: VarlenMeta,
                    scale: float) -> torch.Tensor:
    """torch's flash varlen forward (fp16 / bf16) over the paged pool through ``meta.block_table``, causal at
    the bottom right; blocks of a multiple of 256 tokens."""
    splits = {"num_splits": meta.num_splits} if meta.num_splits is not None and _takes_splits() else {}
    out = torch.ops.aten._flash_attention_forward(
        q, kc, vc, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, 0.0, True, False,
        scale=scale, seqused_k=meta.used_k, block_table=meta.block_table, **splits)[0]
    return out.reshape(q.shape[0], -1)


# the call flash_attention makes: these arguments by position, then these by keyword
FLASH_POSITIONAL = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
                    "return_debug_mask")
FLASH_KEYWORDS = ("scale", "seqused_k", "block_table")
_warned: set[str] = set()


def _flash_schema() -> object | None:
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return None if op is None else op.default._schema


@functools.cache
def _takes_splits() -> bool:
    """Whether this torch's flash op takes ``num_splits`` (without it the op chooses from ``max_k``)."""
    schema = _flash_schema()
    return schema is not None and any(a.name == "num_splits" for a in schema.arguments)


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
              head_dim: int, seed: int = 0, block_size: int = FLASH_BLOCK_TOKENS) -> str | None:
    """None when ``attention`` agrees with the float32 reference on a mixed batch (decode rows, a chunk over a
    cached prefix, a fresh prompt) with consecutive and with scattered blocks, in its own split choice and
    split in parts, with NaN in every row no sequence owns; else why not."""
    gen = torch.Generator().manual_seed(seed)
    qlens, ctxs = [1, 1, 37, 64], [300, 5, 2 * block_size + 20, 0]
    need = [-(-(c + n) // block_size) for n, c in zip(qlens, ctxs, strict=True)]
    blocks = sum(need) + 3
    order = torch.randperm(blocks, generator=gen).tolist()
    firsts = [blocks - need[0], 0, need[1] + 1, need[1] + need[2] + 1]
    layouts = ([list(range(f, f + k)) for f, k in zip(firsts, need, strict=True)],
               [order[sum(need[:b]):sum(need[:b + 1])] for b in range(len(need))])
    scale = head_dim ** -0.5
    staging = PinnedStaging(device)
    for tables in layouts:
        shape = (blocks, block_size, kv_heads, head_dim)
        kc, vc = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
        for t, n, c in zip(tables, qlens, ctxs, strict=True):
            rows = torch.from_numpy(token_rows(t, block_size, 0, c + n))
            rows_of(kc)[rows] = torch.randn(c + n, kv_heads, head_dim, generator=gen)
            rows_of(vc)[rows] = torch.randn(c + n, kv_heads, head_dim, generator=gen)
        q = torch.randn(sum(qlens), heads, head_dim, generator=gen)
        kd, vd = kc.to(device, dtype), vc.to(device, dtype)
        # the mixed batch, then its decode rows alone (the shape a decode graph runs)
        for k in (len(qlens), 2):
            args = (tables[:k], block_size, qlens[:k], ctxs[:k], min(k, 2))
            rows_q = q[:sum(qlens[:k])]
            want = reference_attention(rows_q, kc, vc, upload_meta(PinnedStaging(torch.device("cpu")), *args)[0],
                                       scale)
            meta = upload_meta(staging, *args)[0]
            for splits in (None, 3):
                try:
                    got = attention(rows_q.to(device, dtype), kd, vd, replace(meta, num_splits=splits),
                                    scale).float().cpu()
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
            return flash_attention, "flash varlen attention (torch, paged through block tables)"
        log.warning("qasr: flash varlen attention failed its self-test (%s); using the portable attention", why)
    return reference_attention, f"portable padded attention ({why})"
