"""The official streaming algorithm written plainly: every step re-encodes all the audio so far. The reference
``Session`` is tested against, token for token."""

from __future__ import annotations

import numpy as np

from qasr.engine.engine import Engine, RequestSpec
from qasr.model.checkpoint import Checkpoint
from qasr.model.config import audio_token_count
from qasr.streaming.config import StreamConfig
from qasr.streaming.pcm import as_float_pcm
from qasr.streaming.steps import StepResult, StreamText
from qasr.streaming.text import PromptBuilder


class OracleStream:
    def __init__(self, engine: Engine, checkpoint: Checkpoint, config: StreamConfig | None = None) -> None:
        self.engine = engine
        self.checkpoint = checkpoint
        self.config = config = config or StreamConfig()
        prompts = PromptBuilder(checkpoint.tokenizer, checkpoint.special, config.context, config.language)
        self.state = StreamText(config, prompts)
        self.audio = np.zeros(0, dtype=np.float32)  # decoded so far
        self.pending = np.zeros(0, dtype=np.float32)  # pushed, not yet a full chunk
        self.finished = False

    def push(self, pcm: np.ndarray) -> list[StepResult]:
        """Add audio; one decode per full chunk."""
        if self.finished:
            raise RuntimeError("the stream is finished")
        self.pending = np.concatenate([self.pending, as_float_pcm(pcm)])
        n = self.config.chunk_size_samples
        out = []
        while len(self.pending) >= n:
            self.audio = np.concatenate([self.audio, self.pending[:n]])
            self.pending = self.pending[n:]
            out.append(self._decode(self.state.prefix(), final=False))
        return out

    def finish(self) -> StepResult | None:
        """Decode the leftover audio; None when there is none (or less than a feature frame in all)."""
        if self.finished:
            raise RuntimeError("the stream is finished")
        self.finished = True
        if not len(self.pending):
            return None
        self.audio = np.concatenate([self.audio, self.pending])
        self.pending = self.pending[:0]
        if len(self.audio) < self.checkpoint.features.hop_length:
            return None
        return self._decode(self.state.prefix(at_finish=True), final=True)

    def _decode(self, prefix: str, final: bool) -> StepResult:
        frames = len(self.audio) // self.checkpoint.features.hop_length
        n_audio = audio_token_count(frames, self.checkpoint.config.encoder.conv_chunk_frames)
        prompt = self.state.prompts(n_audio, prefix)
        result = self.engine.submit(RequestSpec(prompt, self.config.max_new_tokens,
                                                waveform=self.audio.copy())).result()
        return self.state.absorb(len(self.audio), prefix, prompt, result.token_ids, final)

    @property
    def results(self) -> list[StepResult]:
        return self.state.results
