"""Frame scorers behind the VAD: each turns 512-sample frames of 16 kHz audio into speech probabilities.

A scorer is stateful (it carries the model's recurrent state and the previous frame's tail), so frames
must be given in order, each exactly once. Three exist:

* :class:`SileroOnnx`: silero-vad's "sequence" ONNX export, which runs a whole block of frames per
  ONNX Runtime call. It computes the same per-frame probabilities as the stock one-frame-per-call model,
  without a Python round trip per 32 ms frame (measured in docs/segmentation.md).
* :class:`SileroJit`: the TorchScript export, one frame per call; used when onnxruntime is missing.
* :class:`EnergyScorer`: no model at all, for installs without silero-vad.

The silero model files ship as package data of the ``silero-vad`` wheel; its Python code imports
torchaudio, which we neither need nor can rely on, so only the data files are used.
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import math
import threading
from typing import Protocol

import numpy as np

FRAME = 512  # samples per frame at 16 kHz: the only window the 16 kHz silero model accepts
CONTEXT = 64  # the model sees the previous frame's last 64 samples in front of each frame
_STATE = 128
_SEQUENCE_MODEL = "silero_vad_16k_sequence.onnx"
_JIT_MODEL = "silero_vad.jit"


class FrameScorer(Protocol):
    def score(self, frames: np.ndarray) -> np.ndarray:
        """Speech probabilities, shape (n,), for ``frames`` of shape (n, FRAME) following the last call."""
        ...


def silero_available() -> bool:
    """True when the silero model files are installed (the package itself is never imported)."""
    return importlib.util.find_spec("silero_vad") is not None


def onnxruntime_available() -> bool:
    return importlib.util.find_spec("onnxruntime") is not None


def _model_path(name: str) -> str:
    # importlib.resources on the data sub-package does not execute silero_vad/__init__.py (which would
    # import torch and torchaudio): only the parent's spec is looked up.
    return str(importlib.resources.files("silero_vad.data").joinpath(name))


@functools.lru_cache(maxsize=1)
def _onnx_session():  # one session per process: InferenceSession.run is thread-safe, state is ours
    import onnxruntime as ort

    options = ort.SessionOptions()
    # VAD is a small, sequential recurrent model: extra threads only add synchronisation cost, and the
    # engine's own matmuls want the cores.
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # the export carries unused initialisers ORT warns about on every load
    import torch  # loaded anyway wherever qasr transcribes

    threads = torch.get_num_threads()
    session = ort.InferenceSession(_model_path(_SEQUENCE_MODEL), options, providers=["CPUExecutionProvider"])
    # Making a session with intra_op_num_threads=1 also drops the process's OpenMP thread count to 1 (seen
    # with onnxruntime 1.2x wheels): torch, and every thread started afterwards (the engine's), would then
    # run on one core. Put it back.
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return session


_JIT_LOCK = threading.Lock()  # the shared TorchScript module holds the recurrent state of whoever runs it


@functools.lru_cache(maxsize=1)
def _jit_model():
    import torch

    model = torch.jit.load(_model_path(_JIT_MODEL), map_location="cpu")
    model.eval()
    return model


def _with_context(frames: np.ndarray, previous_tail: np.ndarray) -> np.ndarray:
    """Prefix every frame with the last CONTEXT samples of the frame before it."""
    tails = np.empty((frames.shape[0], CONTEXT), dtype=np.float32)
    tails[0] = previous_tail
    tails[1:] = frames[:-1, -CONTEXT:]
    return np.concatenate((tails, frames), axis=1)


class SileroOnnx:
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
            # The module keeps its recurrent state in attributes and is shared by every detector, so
            # each call loads this detector's state into it, runs, and reads the state back.
            model = self._model
            model._state, model._context, model._last_sr, model._last_batch_size = self._state, self._tail, 16000, 1
            for i, frame in enumerate(torch.from_numpy(np.ascontiguousarray(frames))):
                out[i] = float(model(frame, 16000))
            self._state, self._tail = model._state, model._context
        return out


class EnergyScorer:
    """Frame loudness against a tracked noise floor, mapped to a pseudo-probability.

    The floor follows quieter frames at once and rises slowly (``_RISE_DB`` per frame, ~1.5 dB/s), so
    steady background noise is absorbed within seconds while a spoken word (a few hundred ms) is not.
    12 dB above the floor maps to 0.5, so the default threshold means "4x the noise amplitude"; frames
    under an absolute floor of ``_SILENCE_DB`` are never speech.
    """

    _RISE_DB = 0.05
    _SILENCE_DB = -55.0
    _MIN_DB = -100.0

    def __init__(self) -> None:
        self._floor: float | None = None

    def score(self, frames: np.ndarray) -> np.ndarray:
        power = np.mean(np.square(frames, dtype=np.float64), axis=1)
        levels = 10.0 * np.log10(np.maximum(power, 10.0 ** (self._MIN_DB / 10.0)))
        out = np.empty(frames.shape[0], dtype=np.float32)
        for i, level in enumerate(levels):  # sequential by nature: the floor depends on every earlier frame
            level = float(level)
            floor = level if self._floor is None else min(level, self._floor + self._RISE_DB)
            self._floor = floor
            snr = level - floor
            out[i] = 0.0 if level < self._SILENCE_DB else 1.0 / (1.0 + math.exp(-(snr - 12.0) / 2.0))
        return out
