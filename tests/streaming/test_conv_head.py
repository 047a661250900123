"""Kept conv output: a live session's open window is re-encoded every step, and the conv front end's
output of its whole final chunks is handed back (a conv head) instead of convolving them again. The
rows must keep their bits, in float32, bf16 and int8 engines, through a rise of the log-mel floor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import noise

from qasr.audio.features import LogMel
from qasr.engine.request import EncodeResult
from qasr.streaming.config import StreamConfig
from qasr.streaming.logmel import StreamingLogMel
from qasr.streaming.windows import WindowEncoder


class EveryChunkEncoder(WindowEncoder):
    """The window encoder without kept conv output: every step convolves the whole open window."""

    def _run(self, mel: StreamingLogMel, window: int) -> EncodeResult:
        start = window * self.window_frames
        return self.engine.submit_encode(mel.features(start, min(mel.frames, start + self.window_frames))).result()


def test_encoder_with_conv_heads_gives_the_same_bits(tiny_asr) -> None:  # noqa: ANN001
    engine = tiny_asr._core.engine
    tower, kernels, batch = engine.prepared.model.audio_tower, engine.core.runner.kernels, engine.core.runner.conv_batch
    cf = tower.cfg.conv_chunk_frames
    feats = [LogMel(tiny_asr._core.checkpoint.features)(noise(s, seed=k)) for k, s in enumerate((2.5, 7.9, 1.0, 0.3))]
    with torch.inference_mode():
        whole = tower.encode(feats, conv_batch=batch, kernels=kernels)
        # utterance i gives its first i chunks as a head (the 0.3 s one none); packed together in one call
        heads = [whole.conv[0][:1], whole.conv[1][:5], None, None]
        rest = [f[:, (h.shape[0] if h is not None else 0) * cf:] for f, h in zip(feats, heads, strict=True)]
        split = tower.encode(rest, heads, conv_batch=batch, kernels=kernels)
    for k, (a, b) in enumerate(zip(whole.rows, split.rows, strict=True)):
        assert torch.equal(a, b), k
    assert [c.shape[0] for c in split.conv] == [2, 3, 1, 1]  # only the chunks after the heads were convolved
    assert torch.equal(split.conv[1], whole.conv[1][5:])


def test_submit_encode_takes_a_conv_head_and_refuses_a_wrong_one(tiny_asr) -> None:  # noqa: ANN001
    engine = tiny_asr._core.engine
    enc = tiny_asr._core.checkpoint.config.encoder
    cf, tpc = enc.conv_chunk_frames, enc.tokens_per_conv_chunk
    feats = LogMel(tiny_asr._core.checkpoint.features)(noise(4.4, seed=7))
    whole = engine.submit_encode(feats).result(timeout=60)
    assert whole.conv.shape == (5, tpc, enc.d_model)
    split = engine.submit_encode(feats[:, 3 * cf:], conv_head=whole.conv[:3]).result(timeout=60)
    assert torch.equal(split.rows, whole.rows) and torch.equal(split.conv, whole.conv[3:])
    bad = [whole.conv[:, :-1], whole.conv[0], whole.conv[:0], whole.conv[:2].to(torch.int32),
           torch.full_like(whole.conv[:2], float("nan"))]
    for head in bad:
        with pytest.raises(ValueError, match="conv_head"):
            engine.submit_encode(feats[:, 2 * cf:], conv_head=head)
    window_chunks = enc.window_tokens // tpc
    with pytest.raises(ValueError, match="one attention window"):  # head + frames past one window
        engine.submit_encode(feats, conv_head=whole.conv[:1].expand(window_chunks, -1, -1).contiguous())


@pytest.mark.parametrize("setup", ["float32", "bfloat16", "int8"])
def test_window_encoder_keeps_conv_output_and_the_bits(tiny_original, setup: str) -> None:  # noqa: ANN001
    """A 21 s stream grown by uneven steps (about a second each) with a loud stretch at 12 s that raises
    the log-mel floor: at every step the rows equal those of convolving every chunk again, and a step
    convolves at most two chunks unless the floor moved."""
    from qasr import ASR

    dtype = "float32" if setup == "float32" else "bfloat16"
    asr = ASR.from_pretrained(tiny_original, device="cpu", dtype=dtype, quantize="int8" if setup == "int8" else None)
    try:
        rng = np.random.default_rng(5)
        wave = np.concatenate([noise(12.0, seed=1), noise(1.0, seed=2) * 40, noise(8.0, seed=3)])
        mel = StreamingLogMel(asr._core.checkpoint.features)
        kept, every = WindowEncoder(asr._core.engine), EveryChunkEncoder(asr._core.engine)
        total = convolved = 0
        at = 0
        while at < wave.size:
            at = min(wave.size, at + 16000 + int(rng.integers(-3000, 3000)))
            floor = float(mel.floor)
            mel.advance(wave[:at])
            a, b = kept.encode(mel), every.encode(mel)
            assert torch.equal(a.rows, b.rows), at
            if float(mel.floor) == floor:
                assert a.conv_chunks <= 2, (at, a.conv_chunks)
            total += b.conv_chunks
            convolved += a.conv_chunks
        assert convolved < total / 2  # about two chunks a step against the whole open window
    finally:
        asr.close()


def test_a_session_records_the_chunks_it_convolved(tiny_asr) -> None:  # noqa: ANN001
    session = tiny_asr.stream(StreamConfig(chunk_size_sec=1.0, max_new_tokens=3))
    wave = noise(6.0, seed=11)
    for i in range(0, wave.size, 16000):
        session.push(wave[i:i + 16000])
    session.finish()
    chunks = session.stats.conv_chunks
    assert len(chunks) == len(session.stats.prefill_tokens) == 6
    # 1 s steps: the chunk that just became final (its last frames waited for the next samples) and the new one
    assert chunks[0] == 1 and all(c == 2 for c in chunks[1:]), chunks



def test_a_short_call_gets_the_smallest_zero_dummy_and_the_same_bits(tiny_asr) -> None:  # noqa: ANN001
    """A call under 16 rows gets a zero dummy utterance (torch's GEMMs give a handful of rows other bits):
    one chunk when that reaches 16 rows (a lone 1 s chunk, a live turn's first step), two otherwise."""
    engine = tiny_asr._core.engine
    tower, kernels, batch = engine.prepared.model.audio_tower, engine.core.runner.kernels, engine.core.runner.conv_batch
    convolved: list[int] = []
    real = tower.conv_front
    tower.conv_front = lambda chunks, *a, **k: (convolved.append(chunks.shape[0]), real(chunks, *a, **k))[1]
    try:
        mel = LogMel(tiny_asr._core.checkpoint.features)
        one_chunk, tiny = mel(noise(1.0, seed=31)), mel(noise(0.05, seed=32))
        with torch.inference_mode():
            alone = [tower([f], conv_batch=batch, kernels=kernels)[0] for f in (one_chunk, tiny)]
            packed = tower([one_chunk, tiny, mel(noise(9.0, seed=33))], conv_batch=batch, kernels=kernels)
    finally:
        del tower.conv_front
    assert convolved[:2] == [2, 3]  # 13 rows + a 1-chunk dummy; 1 row + a 2-chunk dummy
    assert torch.equal(alone[0], packed[0]) and torch.equal(alone[1], packed[1])
