"""Shared fixtures: tiny random checkpoints in both layouts (same seed -> same weights); the demo model and
three sentences it knows, spoken by espeak-ng voices."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from qasr.audio.features import LogMel
from qasr.engine.kv_cache import single_prefill
from qasr.model.checkpoint import load_checkpoint
from qasr.model.config import audio_token_count
from qasr.model.prompt import build_prompt
from qasr.testing import make_tiny_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_original(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_original"), layout="original", seed=0)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_hf"), layout="hf", seed=0)


@pytest.fixture(scope="session")
def tiny_asr(tiny_original):
    from qasr import ASR

    return ASR.from_pretrained(tiny_original, device="cpu", dtype="float32")


DEMO = Path(__file__).resolve().parent.parent / "models" / "qasr-demo-en"


@pytest.fixture(scope="session")
def demo():  # noqa: ANN201
    """The bundled demo model, float32 on CPU (one engine for every module that uses it)."""
    from qasr import ASR

    assert (DEMO / "config.json").exists(), f"the demo model is missing: {DEMO}"
    asr = ASR.from_pretrained(DEMO, device="cpu", dtype="float32")
    yield asr
    asr.close()


@pytest.fixture(scope="session")
def demo_clips(tmp_path_factory: pytest.TempPathFactory) -> list[np.ndarray]:
    """Three sentences from the demo model's domain, 16 kHz float32, each in its own voice."""
    from qasr.audio.io import load_audio
    from qasr.testing.speech import speak

    d = tmp_path_factory.mktemp("demo_clips")
    texts = ("set an alarm for six forty five", "turn off the lights in the bedroom",
             "what is the weather like in paris on friday")
    voices = (("en-us", 160, 50), ("en-gb", 150, 40), ("en-us+f3", 175, 60))
    return [load_audio(speak(t, d / f"c{i}.wav", voice=v, speed=s, pitch=p))
            for i, (t, (v, s, p)) in enumerate(zip(texts, voices, strict=True))]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, except that a NaN may be any NaN (torch's own bf16 loops give NaN with more than one bit
    pattern: engine/cpu/silu_mul.py)."""
    return bool(((a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())).all())


def noise(seconds: float, seed: int = 0) -> np.ndarray:
    """Band-limited-ish noise with a slow envelope, so features vary over time."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * 16000))
    env = 0.05 + 0.1 * np.abs(np.sin(np.arange(n) / 16000 * 2.3))
    return (env * rng.standard_normal(n)).astype(np.float32)


@pytest.fixture(scope="module")
def ck(tiny_original):  # noqa: ANN001, ANN201 - a path fixture; a Checkpoint
    """The tiny checkpoint loaded in float32 on the CPU (the engine tests' default)."""
    return load_checkpoint(tiny_original, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def ck_bf16(tiny_original):  # noqa: ANN001, ANN201
    """bf16 on CPU: the engine swaps in prepacked linears (qasr's AVX512-BF16 kernel where it builds)."""
    return load_checkpoint(tiny_original, device="cpu", dtype="bfloat16")


def prompt_for(ck, wave: np.ndarray, context: str = "") -> list[int]:  # noqa: ANN001 - a Checkpoint
    """The chat prompt of a 16 kHz waveform for ``ck``, its audio placeholders expanded."""
    return build_prompt(ck.tokenizer, ck.special, audio_token_count(len(wave) // 160), context)


def one_behind_a_queue(ck, config, queued: int, queued_seconds: float, queued_tokens: int,  # noqa: ANN001
                       queued_kwargs: dict | None = None,
                       late_kwargs: dict | None = None) -> tuple[list[int], int, int]:
    """``queued`` requests of ``queued_seconds`` of noise (``queued_tokens`` forced tokens, ``queued_kwargs``)
    submitted at once to an engine made with ``config``; once two steps have run, one more of 1 s (6 tokens,
    ``late_kwargs``). Returns its tokens, the steps from its submit to its end, and the steps the whole run
    took: how long a late request waits behind a queue, counted in engine steps (not seconds, which the
    shared machines move by 2x)."""
    from qasr.engine.engine import Engine, RequestSpec

    with Engine(ck, config) as engine:
        wave = noise(queued_seconds, seed=1)
        ahead = [engine.submit(RequestSpec(prompt_for(ck, wave), queued_tokens, waveform=wave, ignore_eos=True,
                                           **(queued_kwargs or {}))) for _ in range(queued)]
        while engine.steps < 2:  # the queue is under way
            pass
        late = noise(1.0, seed=2)
        spec = RequestSpec(prompt_for(ck, late), 6, waveform=late, ignore_eos=True, **(late_kwargs or {}))
        at = engine.steps
        result = engine.submit(spec).result(timeout=120)
        took = engine.steps - at
        for f in ahead:
            f.result(timeout=300)
        return result.token_ids, took, engine.steps


def greedy_without_engine(ck, wave: np.ndarray, new_tokens: int, kernels,  # noqa: ANN001
                          kv_dtype: str = "auto") -> list[int]:
    """Greedy decoding of ``ck`` (a Checkpoint) with ``kernels`` (a Kernels) and the whole sequence recomputed
    at every token: no engine, no KV reuse, no batch, torch's attention over a pool holding ``kv_dtype``. The
    plain references of the quantized modes and of the int8 KV cache."""
    from qasr.audio.features import LogMel
    from qasr.engine.kv_cache import single_prefill

    model = ck.model
    prompt = prompt_for(ck, wave)
    with torch.inference_mode():
        audio = model.audio_tower([LogMel(ck.features)(wave)], kernels=kernels)[0]
        ids = list(prompt)
        for _ in range(new_tokens):
            cache, meta = single_prefill(ck.config.decoder, len(ids), ck.device, ck.dtype, kv_dtype)
            logits = model(torch.tensor(ids), torch.arange(len(ids)), cache, meta,
                           logits_rows=torch.tensor([len(ids) - 1]), audio_embeds=audio, kernels=kernels)
            ids.append(int(logits[0].argmax()))
    return ids[len(prompt):]


def int8_unfold_conv(module: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The int8 convolution computed another way than qasr's: F.unfold's (cin, kh, kw) feature order, the int8
    reference product per row, NCHW output."""
    import torch.nn.functional as F

    from qasr.engine.cpu.int8 import int8_linear_reference, quantize_weight

    n, _, h, w = x.shape
    cols = F.unfold(x.float(), module.kernel_size, padding=module.padding, stride=module.stride)  # (n, K, L)
    rows = cols.transpose(1, 2).reshape(-1, cols.shape[1]).to(x.dtype)
    w_q, scale = quantize_weight(module.weight.reshape(module.out_channels, -1))
    y = int8_linear_reference(rows, w_q, scale, module.bias)
    (kh, kw), (sh, sw), (ph, pw) = module.kernel_size, module.stride, module.padding
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    return y.view(n, ho * wo, -1).transpose(1, 2).reshape(n, -1, ho, wo)


def reference_logprobs(ck, wave: np.ndarray, prompt: list[int], tokens: list[int]) -> list[float]:
    """The plain reference: one float32 forward of the model with torch's own ops over the prompt and the
    generated tokens (teacher-forced, no engine, no batch), then each chosen token's log-softmax."""
    model = ck.model
    audio = model.encode_audio([LogMel(ck.features)(wave)])[0]
    ids = prompt + tokens[:-1]
    cache, meta = single_prefill(ck.config.decoder, len(ids), ck.device, ck.dtype)
    rows = torch.arange(len(prompt) - 1, len(ids))
    with torch.inference_mode():
        logits = model(torch.tensor(ids), torch.arange(len(ids)), cache, meta, logits_rows=rows, audio_embeds=audio)
    logprobs = torch.log_softmax(logits.float(), -1)
    return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def record_log_mel_and_submits(core, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list]:  # noqa: ANN001
    """Make ``core`` (a transcribe Core) record the thread of each log-mel its pieces make and each spec it
    submits to its engine; returns those two lists, filled as it runs."""
    made_on: list[str] = []
    specs: list = []

    class Recording(LogMel):
        def __call__(self, samples):  # noqa: ANN001, ANN204
            made_on.append(threading.current_thread().name)
            return super().__call__(samples)

    real_submit = core.engine.submit

    def submit(spec, *args, **kwargs):  # noqa: ANN001, ANN202
        specs.append(spec)
        return real_submit(spec, *args, **kwargs)

    monkeypatch.setattr(core, "log_mel", Recording(core.checkpoint.features))
    monkeypatch.setattr(core.engine, "submit", submit)
    return made_on, specs
