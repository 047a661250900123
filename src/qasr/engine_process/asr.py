"""The ASR facade over an engine process: what ``qasr serve`` runs."""

from __future__ import annotations

import torch

from qasr.align.aligner import Aligner
from qasr.engine_process.child import EngineSpec
from qasr.engine_process.client import EngineProcess, RemoteEngine
from qasr.model.checkpoint import load_checkpoint
from qasr.transcribe.asr import ASR
from qasr.transcribe.core import Core


def start_asr(spec: EngineSpec, timeout_s: float = 60.0) -> ASR:
    """Start the engine process for ``spec`` and wait until it is ready; the ASR sends it every request and
    keeps only the tokenizer and the configs (its engines: ``asr._core.engine.process``). RuntimeError when the
    engine process fails to load."""
    torch.set_num_threads(1)  # this process makes log-mel at most: the engine process's threads are the CPUs
    checkpoint = load_checkpoint(spec.model, weights=False)
    aligner_checkpoint = None if spec.aligner is None else load_checkpoint(spec.aligner, weights=False)
    if aligner_checkpoint is not None and not aligner_checkpoint.config.is_aligner:
        raise ValueError(f"{spec.aligner} is not a forced-aligner checkpoint (it looks like an ASR model)")
    process = EngineProcess(spec, timeout_s)
    process.start()
    engine = RemoteEngine(process, "asr", checkpoint.features)
    aligner = None
    if aligner_checkpoint is not None:
        aligner = Aligner(aligner_checkpoint, RemoteEngine(process, "aligner", aligner_checkpoint.features))  # type: ignore[arg-type]
    core = Core(checkpoint, engine, aligner, open_turn=engine.open_turn)
    return ASR(checkpoint, core=core)

