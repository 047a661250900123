"""An upload's pieces get their log-mel where the upload is decoded (the decode pool's thread), never on the
event loop that submits them or in an engine step; the engine then holds the only copy."""

from __future__ import annotations

import asyncio
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import soundfile as sf
import torch
from conftest import noise, record_log_mel_and_submits

from qasr.audio.features import LogMel
from qasr.audio.io import EncodedAudio
from qasr.server.work import EngineRun, prepare_upload
from qasr.transcribe.options import TranscribeOptions


def wav(x: np.ndarray) -> EncodedAudio:
    buf = io.BytesIO()
    sf.write(buf, x, 16000, format="WAV", subtype="FLOAT")
    data = buf.getvalue()
    return EncodedAudio("clip.wav", lambda: io.BytesIO(data), len(data))


def test_an_upload_is_submitted_as_features_made_off_the_event_loop(tiny_asr, monkeypatch) -> None:
    core = tiny_asr._core
    made_on, specs = record_log_mel_and_submits(core, monkeypatch)
    x = noise(5.0, seed=5)
    options = TranscribeOptions(segmentation="fixed", max_segment_s=2.5, max_new_tokens=3)
    with ThreadPoolExecutor(1, thread_name_prefix="decode-pool") as pool:
        upload = pool.submit(prepare_upload, core, wav(x), options).result()
    assert made_on == ["decode-pool_0"] * 2
    assert all(p.samples.size == 0 and p.features is None for p in upload.pieces)  # no words: no samples kept

    async def run() -> str:
        engine_run = EngineRun(core, upload, stream=False)
        assert upload.features == []  # handed to the engine, which drops them once encoded
        return (await engine_run.finish()).transcription.text

    text = asyncio.run(run())
    assert made_on == ["decode-pool_0"] * 2 and len(specs) == 2
    assert all(s.waveform is None for s in specs)
    reference = LogMel(core.checkpoint.features)
    assert torch.equal(specs[0].features, reference(x[:40000]))
    monkeypatch.undo()
    assert text == tiny_asr.transcribe((x, 16000), options)[0].text
