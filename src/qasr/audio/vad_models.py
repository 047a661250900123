"""The VAD's frame scorers: 512-sample frames, in order, each once -> speech probabilities.
Only the ``silero-vad`` wheel's model files are used (its code imports torchaudio)."""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import math
import threading
from typing import Protocol

import numpy as np

FRAME = 512  # the only window the 16 kHz silero model accepts
CONTEXT = 64  # samples of the previous frame put in front of each
_STATE = 128
_SEQUENCE_MODEL = "silero_vad_16k_sequence.onnx"
_JIT_MODEL = "silero_vad.jit"


class FrameScorer(Protocol):
    def score(self, frames: np.ndarray) -> np.ndarray:
        """Speech probabilities (n,) for ``frames`` (n, FRAME) that follow the last call's."""
        ...


def silero_available() -> bool:
    return importlib.util.find_spec("silero_vad") is not None


def onnxruntime_available() -> bool:
    return importlib.util.find_spec("onnxruntime") is not None


def _model_path(name: str) -> str:
    # does not run silero_vad/__init__.py (which imports torchaudio)
    return str(importlib.resources.files("silero_vad.data").joinpath(name))


@functools.lru_cache(maxsize=1)
def _onnx_session():  # run() is thread-safe; the state is the caller's
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    import torch

    threads = torch.get_num_threads()
    session = ort.InferenceSession(_model_path(_SEQUENCE_MODEL), options, providers=["CPUExecutionProvider"])
    # the session drops the process's OpenMP thread count to 1: put torch's back
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return session


_JIT_LOCK = threading.Lock()  # the shared module holds its runner's state


@functools.lru_cache(maxsize=1)
def _jit_model():
    import torch

    model = torch.jit.load(_model_path(_JIT_MODEL), map_location="cpu")
    model.eval()
    return model


def _with_context(frames: np.ndarray, previous_tail: np.ndarray) -> np.ndarray:
    tails = np.empty((frames.shape[0], CONTEXT), dtype=np.float32)
    tails[0] = previous_tail
    tails[1:] = frames[:-1, -CONTEXT:]
    return np.concatenate((tails, frames), axis=1)


class SileroOnnx:
    """silero's sequence export, a block of frames a call (docs/log's segmentation-vad-backend-timing entry)."""

    def __init__(self) -> None:
        self._session = _onnx_session()
        self._h = np.zeros((1, 1, _STATE), dtype=np.float32)
        self._c = np.zeros((1, 1, _STATE), dtype=np.float32)
        self._tail = np.zeros(CONTEXT, dtype=np.float32)

    def score(self, frames: np.ndarray) -> np.ndarray:
        if frames.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        inputs = _with_context(frames, self._tail)
        probs, self._h, self._c = self._session.run(
            ["speech_probs", "hn", "cn"], {"input": inputs, "h": self._h, "c": self._c}
        )
        self._tail = frames[-1, -CONTEXT:].copy()
        return np.asarray(probs, dtype=np.float32).reshape(-1)


class SileroJit:
    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._model = _jit_model()
        self._state = torch.zeros((2, 1, _STATE))
        self._tail = torch.zeros((1, CONTEXT))

    def score(self, frames: np.ndarray) -> np.ndarray:
        torch = self._torch
        out = np.empty(frames.shape[0], dtype=np.float32)
        with _JIT_LOCK, torch.no_grad():
            # load this detector's state into the shared module, run, read it back
            model = self._model
            model._state, model._context, model._last_sr, model._last_batch_size = self._state, self._tail, 16000, 1
            for i, frame in enumerate(torch.from_numpy(np.ascontiguousarray(frames))):
                out[i] = float(model(frame, 16000))
            self._state, self._tail = model._state, model._context
        return out


class EnergyScorer:
    """Loudness over a noise floor that follows quieter frames at once and rises ``_RISE_DB`` a frame;
    12 dB above it maps to 0.5. Frames under ``_SILENCE_DB`` are never speech."""

    _RISE_DB = 0.05
    _SILENCE_DB = -55.0
    _MIN_DB = -100.0

    def __init__(self) -> None:
        self._floor: float | None = None

    def score(self, frames: np.ndarray) -> np.ndarray:
        power = np.mean(np.square(frames, dtype=np.float64), axis=1)
        levels = 10.0 * np.log10(np.maximum(power, 10.0 ** (self._MIN_DB / 10.0)))
        out = np.empty(frames.shape[0], dtype=np.float32)
        for i, level in enumerate(levels):  # the floor depends on every earlier frame
            level = float(level)
            floor = level if self._floor is None else min(level, self._floor + self._RISE_DB)
            self._floor = floor
            snr = level - floor
            out[i] = 0.0 if level < self._SILENCE_DB else 1.0 / (1.0 + math.exp(-(snr - 12.0) / 2.0))
        return out
