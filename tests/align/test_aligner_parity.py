"""Forced alignment parity with transformers (the oracle) on random aligner checkpoints.

transformers runs Qwen3ASRForTokenClassification on the "-hf" checkpoint with inputs from
Qwen3ASRProcessor.prepare_forced_aligner_inputs and decodes with decode_forced_alignment; qasr's
Aligner runs the same weights (release and "-hf" layouts) through its engine. Prompt ids, class ids at
the timestamp slots and the word timestamps must be equal, the slot logits within 1e-4 (float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import noise
from safetensors.torch import load_file, save_file

from qasr.align.aligner import Aligner
from qasr.audio.features import LogMel
from qasr.engine.engine import EngineConfig
from qasr.engine.kv_cache import single_prefill
from qasr.testing import make_tiny_aligner_checkpoint

transformers = pytest.importorskip("transformers")

# the official layout, rendered by the processor's chat template (the aligner uses no chat markup)
CHAT_TEMPLATE = (
    "{%- for m in messages %}{%- for c in m['content'] %}{%- if c['type'] == 'audio' %}"
    "<|audio_start|><|audio_pad|><|audio_end|>{%- else %}{{ c['text'] }}<timestamp><timestamp>{%- endif %}"
    "{%- endfor %}{%- endfor %}"
)
LENGTHS = [1.0, 7.0, 20.0, 60.0]
TEXTS = [
    ("English", "The quick brown fox jumps over the lazy dog; it's 12 o'clock, isn't it? Good morning."),
    ("Chinese", "今天天气很好，我们去公园散步吧。Qwen3 模型说: hello world!"),
]
STD = 0.5  # random weights loud enough that the slots get varied classes


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict:
    paths = {layout: make_tiny_aligner_checkpoint(tmp_path_factory.mktemp(f"aligner_{layout}"), layout=layout,
                                                  seed=3, std=STD)
             for layout in ("original", "hf")}
    _decorrelate_head(paths)
    return paths


def _decorrelate_head(paths: dict) -> None:
    """In a random model every slot's hidden state is mostly one shared vector, so one class wins
    everywhere. Removing that direction from the classifier's rows leaves the argmax to what differs
    between slots (audio, words, position): varied classes and out-of-order times for the repair."""
    with Aligner.from_pretrained(paths["original"], device="cpu", dtype="float32") as aligner:
        ck = aligner.checkpoint
        hidden = []
        for seconds, (language, text) in zip([3.0, 20.0], TEXTS, strict=True):
            wave, _, prompt = aligner._prepare(noise(seconds, seed=99), text, language)
            audio = ck.model.encode_audio([LogMel(ck.features)(wave)])[0]
            cache, meta = single_prefill(ck.config.decoder, len(prompt.ids), ck.device, ck.dtype)
            with torch.inference_mode():
                x = ck.model.embed(torch.tensor(prompt.ids), audio)
                hidden.append(ck.model.model(x, torch.arange(len(prompt.ids)), cache, meta)[prompt.slots])
    u = torch.cat(hidden).mean(0)
    u = u / u.norm()
    for layout, key in (("original", "thinker.lm_head.weight"), ("hf", "score.weight")):
        file = paths[layout] / "model.safetensors"
        state = load_file(str(file))
        w = state[key]
        state[key] = (w - (w @ u)[:, None] * u[None, :]).contiguous()
        save_file(state, str(file), metadata={"format": "pt"})


def make_oracle(hf_dir):  # noqa: ANN001, ANN201 - a path; (model, processor)
    """transformers' forced aligner and its processor on an -hf checkpoint, in float32."""
    model = transformers.Qwen3ASRForTokenClassification.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    processor = transformers.Qwen3ASRProcessor(feature_extractor=transformers.Qwen3ASRFeatureExtractor(),
                                               tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    return model.eval(), processor


def load_aligners(paths: dict) -> dict:
    """qasr's Aligner on each layout's checkpoint, in float32."""
    return {layout: Aligner.from_pretrained(path, device="cpu", dtype="float32") for layout, path in paths.items()}


@pytest.fixture(scope="module")
def oracle(checkpoints):
    return make_oracle(checkpoints["hf"])


@pytest.fixture(scope="module")
def aligners(checkpoints):
    out = load_aligners(checkpoints)
    yield out
    for a in out.values():
        a.close()


def _reference(oracle, wave: np.ndarray, text: str, language: str) -> tuple[list[int], torch.Tensor, list, list]:
    """One sample at a time (no padding): prompt ids, slot logits, slot class ids, decoded words."""
    model, processor = oracle
    inputs, words = processor.prepare_forced_aligner_inputs(wave, text, language=language)
    with torch.inference_mode():
        logits = model(input_ids=inputs["input_ids"], input_features=inputs["input_features"],
                       input_features_mask=inputs["input_features_mask"]).logits
    ids = inputs["input_ids"][0]
    slots = logits[0][ids == model.config.timestamp_token_id]
    decoded = processor.decode_forced_alignment(logits, inputs["input_ids"], words, model.config.timestamp_token_id)
    return ids.tolist(), slots, slots.argmax(-1).tolist(), decoded[0]


def _slot_logits(aligner: Aligner, wave: np.ndarray, text: str, language: str) -> tuple[list[int], torch.Tensor]:
    """qasr's prompt and the head's logits at its slots, from one plain prefill (no engine)."""
    wave_, _, prompt = aligner._prepare(wave, text, language)
    ck = aligner.checkpoint
    audio = ck.model.encode_audio([LogMel(ck.features)(wave_)])[0]
    cache, meta = single_prefill(ck.config.decoder, len(prompt.ids), ck.device, ck.dtype)
    with torch.inference_mode():
        logits = ck.model(torch.tensor(prompt.ids), torch.arange(len(prompt.ids)), cache, meta,
                          logits_rows=torch.tensor(prompt.slots), audio_embeds=audio)
    return prompt.ids, logits


@pytest.mark.parametrize("seconds", LENGTHS)
@pytest.mark.parametrize("language,text", TEXTS)
def test_alignment_matches_transformers(oracle, aligners, seconds, language, text) -> None:
    wave = noise(seconds, seed=int(seconds))
    ref_ids, ref_logits, ref_classes, ref_words = _reference(oracle, wave, text, language)
    ids, logits = _slot_logits(aligners["original"], wave, text, language)
    assert ids == ref_ids
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    for layout, aligner in aligners.items():
        ck = aligner.checkpoint
        prompt = aligner._prepare(wave, text, language)[2]
        classes = aligner.engine.submit_alignment(prompt.ids, positions=prompt.slots, waveform=wave).result()
        assert classes == ref_classes, layout
        words = aligner.align(wave, text, language, sample_rate=16000)[0]
        assert [(w.text, w.start, w.end) for w in words] == \
            [(r["text"], r["start_time"], r["end_time"]) for r in ref_words], layout
        assert ck.config.layout == layout
    assert len(set(ref_classes)) >= 2  # a degenerate random model would make this test meaningless


def test_batched_alignment_equals_one_at_a_time(checkpoints) -> None:
    """Several requests in one engine, prefilled in small chunks that share steps, give the ids each
    gets alone."""
    config = EngineConfig(step_tokens=200, prefill_chunk=32)
    with Aligner.from_pretrained(checkpoints["original"], device="cpu", dtype="float32",
                                 engine_config=config) as aligner:
        pieces = [(noise(s, seed=k), TEXTS[k % 2][1]) for k, s in enumerate([3.0, 11.5, 0.3, 17.0, 6.2])]
        prompts = [aligner._prepare(w, t, None) for w, t in pieces]
        runner = aligner.engine.core.runner
        forward, shared = runner.forward, []

        def recording(plan):  # noqa: ANN001, ANN202 - how many requests each packed forward prefilled
            shared.append(len({id(r) for r, _ in plan.prefill}))
            return forward(plan)

        runner.forward = recording
        futures = [aligner.engine.submit_alignment(p.ids, positions=p.slots, waveform=w) for w, _, p in prompts]
        batched = [f.result() for f in futures]
        runner.forward = forward
        alone = [aligner.engine.submit_alignment(p.ids, positions=p.slots, waveform=w).result()
                 for w, _, p in prompts]
        assert batched == alone
        assert max(shared) >= 2  # the requests really shared forwards
        words = aligner.align_pieces([w for w, _ in pieces], [t for _, t in pieces], None,
                                     offsets=[0.0, 10.0, 20.0, 30.0, 40.0])
        assert [w[0].start >= 10.0 * k for k, w in enumerate(words)] == [True] * 5

