"""A streamed upload's first piece is its group's lead, so its text starts after its own work; an upload
answered whole has none."""

from __future__ import annotations

import asyncio

from conftest import noise, record_log_mel_and_submits
from test_upload_features import wav

from qasr.server.work import EngineRun, prepare_upload
from qasr.transcribe.options import TranscribeOptions


def test_a_streamed_uploads_first_piece_leads(tiny_asr, monkeypatch) -> None:
    core = tiny_asr._core
    _, specs = record_log_mel_and_submits(core, monkeypatch)
    options = TranscribeOptions(segmentation="fixed", max_segment_s=2.5, max_new_tokens=3)

    async def run(stream: bool) -> str:
        upload = prepare_upload(core, wav(noise(7.5, seed=6)), options)
        engine_run = EngineRun(core, upload, stream=stream)
        deltas = [d async for d in engine_run.deltas()] if stream else []
        text = (await engine_run.finish()).transcription.text
        assert not stream or "".join(deltas) == text
        return text

    streamed = asyncio.run(run(True))
    assert [s.lead for s in specs] == [True, False, False]
    specs.clear()
    whole = asyncio.run(run(False))
    assert [s.lead for s in specs] == [False, False, False]
    assert streamed == whole  # the place in line, not the text
