"""After a CPU preparation the packed copy is a weight's only resident copy: the checkpoint's float weights map
its file and their pages leave memory once packed (model/weights.py: release_file_pages), with no value changed
and no weight written in place lost."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qasr.engine.cpu import native
from qasr.engine.cpu.prepare import prepare_cpu
from qasr.model.checkpoint import load_checkpoint
from qasr.model.weights import release_file_pages, resident_bytes
from qasr.testing import make_tiny_checkpoint


def pagemap_readable() -> bool:
    touched = torch.ones(1 << 16)
    return resident_bytes(touched) > 0


pytestmark = pytest.mark.skipif(not pagemap_readable(), reason="/proc/self/pagemap is not readable here")


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a path
    # stored in the dtype it is loaded in: mapped, not converted; a 1 MiB embedding, the LM head tied to it
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_bf16"), dtype=torch.bfloat16, tied=True,
                                vocab_size=8192)


def loaded(path) -> nn.Module:  # noqa: ANN001
    model = load_checkpoint(path, device="cpu", dtype="bfloat16").model
    for p in model.parameters():
        p.float().sum()  # every page resident, as after a forward
    return model


def packed_weights(model: nn.Module, prepared) -> list[torch.Tensor]:  # noqa: ANN001
    """The weights of the linears and convolutions the preparation packed."""
    linear = prepared.kernels.linear
    packed = getattr(linear, "packed", None)
    if packed is None:
        packed = {m: None for m in getattr(linear, "products", {})}
        packed.update({m: None for group in getattr(linear, "groups", {}) for m in group})
    convs = prepared.kernels.conv
    packed_convs = {**getattr(convs, "gemm", {}), **getattr(convs, "weights", {})}
    return [m.weight for m in (*packed, *packed_convs)]


def test_loading_maps_the_file(tiny_bf16) -> None:
    """A weight loaded in its file's dtype is a view of the mapped file, not a copy: once read, its pages are
    the file's (droppable), where a copy's would be private memory."""
    embeddings = load_checkpoint(tiny_bf16, device="cpu", dtype="bfloat16").model.model.embed_tokens.weight
    embeddings.float().sum()  # every page resident
    whole = resident_bytes(embeddings)
    assert whole >= embeddings.nbytes / 2
    assert release_file_pages(embeddings) == whole and resident_bytes(embeddings) == 0


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_packed_weights_leave_memory(tiny_bf16, quantize) -> None:
    model = loaded(tiny_bf16)
    before = {name: p.clone() for name, p in model.named_parameters()}
    use_native = quantize is None  # int8/int4: the torch reference packs the same weights everywhere
    if quantize is None and native.linear_kernel() is None:
        pytest.skip("no native bf16 GEMM here (it needs AVX512-BF16 or AMX)")
    prepared = prepare_cpu(model, use_native=use_native, quantize=quantize)
    weights = packed_weights(model, prepared)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(weights) >= len(linears)  # every linear packed (and the 480-channel-like convs)
    paged = [w for w in weights if w.numel() * w.element_size() >= 2 * 4096]  # each holds a whole page
    assert paged and all(resident_bytes(w) == 0 for w in paged)
    packed_at = {w.data_ptr() for w in weights}
    params = list(model.parameters())
    kept = sum(resident_bytes(p) for p in params)
    unpacked = sum(p.numel() * p.element_size() for p in params if p.data_ptr() not in packed_at)
    assert kept <= unpacked  # only the weights still read as they are (norms, the first conv...) stay
    for name, p in model.named_parameters():  # dropped pages read back from the file unchanged
        assert torch.equal(p, before[name]), name


def test_a_weight_written_in_place_is_kept(tiny_bf16) -> None:
    model = loaded(tiny_bf16)
    w = model.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        w.mul_(-2)
    written = w.clone()
    prepared = prepare_cpu(model, use_native=False, quantize="int8")
    assert torch.equal(w, written)
    x = torch.randn(3, w.shape[1], dtype=torch.bfloat16)
    again = prepare_cpu(load_checkpoint(tiny_bf16, device="cpu", dtype="bfloat16").model, False, "int8")
    assert not torch.equal(prepared.kernels.linear(model.model.layers[0].mlp.down_proj, x),
                           again.kernels.linear(again.model.model.layers[0].mlp.down_proj, x))


def test_anonymous_memory_is_never_dropped() -> None:
    t = torch.randn(1 << 16)
    copy = t.clone()
    assert release_file_pages(t) == 0 and torch.equal(t, copy)
