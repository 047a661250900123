"""The decoder's layers bound once (engine/cpu/decoder_plan.py, ``Kernels.decoder_layers``) compute what the module
tree computes on the same kernels, bit for bit, in every CPU mode; the engine uses them; without fused norms
there is no plan."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import noise, prompt_for

from qasr.engine.cpu import native
from qasr.engine.cpu.prepare import prepare_cpu
from qasr.engine.engine import Engine, EngineConfig, RequestSpec
from qasr.engine.kv_cache import KVPool
from qasr.model.checkpoint import load_checkpoint
from qasr.model.decoder import BoundDecoderLayers, bind_decoder_layers
from qasr.testing import make_tiny_checkpoint

# a plan is built only over the fused norms, which are native: without a compiler there is nothing to compare
needs_native = pytest.mark.skipif(native.decoder_ops_kernel() is None, reason="no C++ compiler for the native kernels")

# head_dim 128: the native decode and prefill attention kernels run (they are written for it)
DIMS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128)
MODES = [("float32", None, "auto"), ("bfloat16", None, "auto"), ("bfloat16", "int8", "auto"),
         ("bfloat16", "int8", "int8"), ("float32", "int8", "auto"), ("bfloat16", "int4", "auto")]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a Path
    return make_tiny_checkpoint(tmp_path_factory.mktemp("plan"), seed=3, **DIMS)


def packed_forward(ck, kernels, prepared, kv_dtype: str) -> list[torch.Tensor]:  # noqa: ANN001
    """Logits of three forwards on a fresh pool: a prompt of 70 tokens for sequence A, then a packed forward of
    A's next token (a decode row) beside a 40-token prompt chunk of sequence B, then both decoding."""
    model = ck.model
    pool = KVPool(ck.config.decoder, 8, ck.device, ck.dtype, block_size=16, kv_dtype=kv_dtype,
                  decode_kernel=prepared.decode_attention, prefill_kernel=prepared.prefill_attention)
    a, b = [5, 2, 7, 0, 1], [3, 6, 4]  # block tables, out of order
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.cfg.decoder.vocab_size, (120,), generator=gen)
    steps = [  # (tables, query lengths, context lengths, decode rows)
        ([a], [70], [0], 0),
        ([a, b], [1, 40], [70, 0], 1),
        ([a, b], [1, 1], [71, 40], 2),
    ]
    out, used = [], 0
    with torch.inference_mode():
        for tables, qlens, ctxs, nd in steps:
            meta = pool.build_meta(tables, qlens, ctxs, nd)
            n = sum(qlens)
            positions = torch.cat([torch.arange(c, c + q) for q, c in zip(qlens, ctxs, strict=True)])
            rows = torch.cumsum(torch.tensor(qlens), 0) - 1
            out.append(model(ids[used:used + n], positions, pool, meta, logits_rows=rows, kernels=kernels))
            used += n
    return out


@needs_native
@pytest.mark.parametrize(("dtype", "quantize", "kv_dtype"), MODES)
def test_plan_gives_the_module_trees_bits(path, dtype: str, quantize: str | None, kv_dtype: str) -> None:
    ck = load_checkpoint(path, device="cpu", dtype=dtype)
    prepared = prepare_cpu(ck.model, True, quantize)
    plan = prepared.kernels.decoder_layers
    assert isinstance(plan, BoundDecoderLayers) and "decoder layers bound once" in prepared.description
    calls = []

    def counted(*args):  # noqa: ANN002, ANN202
        calls.append(1)
        return plan(*args)

    with_plan = packed_forward(ck, replace(prepared.kernels, decoder_layers=counted), prepared, kv_dtype)
    assert len(calls) == 3  # every forward went through the plan
    tree = packed_forward(ck, replace(prepared.kernels, decoder_layers=None), prepared, kv_dtype)
    for got, want in zip(with_plan, tree, strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(with_plan[1], with_plan[2])  # the forwards differ: the comparison is not of constants


def test_no_plan_without_fused_norms(path) -> None:
    ck = load_checkpoint(path, device="cpu", dtype="float32")
    prepared = prepare_cpu(ck.model, False)  # torch ops only: the norms are the module's own
    assert prepared.kernels.decoder_layers is None
    assert bind_decoder_layers(ck.model.model, prepared.kernels) is None


@needs_native
def test_engine_decodes_through_the_plan(path) -> None:
    """The engine's forwards call the prepared plan (a stand-in that counts its calls proves it)."""
    ck = load_checkpoint(path, device="cpu", dtype="bfloat16")
    with Engine(ck, EngineConfig(kv_cache_bytes=16 << 20, quantize="int8")) as engine:
        plan = engine.prepared.kernels.decoder_layers
        assert isinstance(plan, BoundDecoderLayers)
        calls = []
        original = BoundDecoderLayers.__call__

        def counted(self, *args):  # noqa: ANN001, ANN002, ANN202
            calls.append(1)
            return original(self, *args)

        BoundDecoderLayers.__call__ = counted  # type: ignore[method-assign]
        try:
            wave = noise(1.0)
            tokens = engine.submit(RequestSpec(prompt_for(ck, wave), 6, waveform=wave,
                                               ignore_eos=True)).result(timeout=120).token_ids
        finally:
            BoundDecoderLayers.__call__ = original  # type: ignore[method-assign]
    assert len(tokens) == 6 and len(calls) >= 6  # the prompt's forward and one per decode step
