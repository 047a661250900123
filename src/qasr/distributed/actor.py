"""The pipeline's ASR stage: a Ray Data actor class holding one engine (no Ray import here). Its
concurrent calls batch together in the engine; each segment comes back as its own Transcription.
"""

from __future__ import annotations

import logging
import os
import pickle
from concurrent.futures import Future, wait

from qasr.audio.io import AudioError
from qasr.distributed import rows
from qasr.distributed.config import EngineSpec
from qasr.transcribe.assemble import outcome_of
from qasr.transcribe.options import TranscribeOptions
from qasr.transcribe.pieces import Piece, make_piece, make_pieces

log = logging.getLogger("qasr.distributed")


class Transcriber:
    """``map_batches`` callable class: one engine per actor, loaded once."""

    def __init__(self, spec: EngineSpec, options: TranscribeOptions) -> None:
        self.core = spec.load()._core
        self.options = options
        self.language = self.core.canonical_language(options.language)  # type: ignore[arg-type]

    def __call__(self, batch: dict) -> dict[str, list]:
        out: list[dict] = []
        started: list[tuple[dict, list[Piece], list[Future]]] = []
        for r in rows.rows_of(batch):
            if r["kind"] == rows.END:
                out.append(r)
                continue
            try:
                pieces = self._pieces(r)
            except AudioError as exc:
                out.append(rows.row(r["item"], r["source"], rows.FAILED, k=r["k"], duration=r["duration"],
                                    error=str(exc)))
                continue
            started.append((r, pieces, [self._submit(p) for p in pieces]))
        wait([f for _, _, futures in started for f in futures])
        if self.core.engine.stats().broken:
            # a broken engine serves nothing more: Ray restarts the actor and retries the call
            log.error("the engine of this ASR actor broke; the actor exits so that Ray replaces it")
            os._exit(1)
        for r, pieces, futures in started:
            part = self.core.assemble(pieces, [outcome_of(f) for f in futures])
            out.append(rows.row(r["item"], r["source"], rows.PART, k=r["k"], offset=r["offset"],
                                duration=r["duration"], part=pickle.dumps(part)))
        return rows.batch(out)

    def _pieces(self, r: dict) -> list[Piece]:
        samples = rows.samples_of(r["samples"])
        common = {"source": r["source"], "item": r["item"], "context": self.options.context,
                  "language": self.language, "max_new_tokens": self.options.max_new_tokens,
                  "tokens_per_second": self.core.max_tokens_per_second}
        if r["kind"] == rows.WHOLE:
            return make_pieces(self.core.checkpoint, samples, max_chunk_sec=self.core.max_chunk_sec, **common)
        return [make_piece(self.core.checkpoint, samples, offset=r["offset"], duration=r["duration"], **common)]

    def _submit(self, piece: Piece) -> Future:
        return self.core.submit_or_refuse(piece, words=self.options.words, ignore_eos=self.options.ignore_eos)
