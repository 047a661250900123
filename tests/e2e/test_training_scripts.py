"""Pieces of the demo models' training scripts that shape what the bundled models learn.

The scripts themselves run for an hour; these check the parts whose mistakes would pass silently:
the aligner's guided-attention loss (it must score the attention the network really computes, and leave
the forward unchanged), the ASR script's joined clips with extra pauses (lengths, texts, phoneme times) and
its frequency warp; the demo data's voice split and the word-run evaluation's voices.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SR = 16000


def _script(name: str) -> ModuleType:
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def aligner_script() -> ModuleType:
    return _script("train_aligner_model")


@pytest.fixture(scope="module")
def demo_script() -> ModuleType:
    return _script("train_demo_model")


def test_guided_store_scores_the_real_attention(aligner_script: ModuleType) -> None:
    torch.manual_seed(0)
    lens = [7, 5]  # two packed sequences: rows 0-6 and 7-11
    heads, kv, d = 4, 2, 8
    q, k, v = torch.randn(12, heads, d), torch.randn(12, kv, d), torch.randn(12, kv, d)
    queries, keys, starts = [5, 11], [2, 8], [0, 7]  # a slot in each sequence, the audio row it should see
    store = aligner_script.GuidedAttentionStore(lens, (1,), (3,), queries, keys, starts)
    plain = aligner_script.PackedCausalStore(lens)
    assert torch.allclose(store.attend(0, q, k, v, None), plain.attend(0, q, k, v, None))
    assert store.losses == []  # layer 0 is not guided
    out = store.attend(1, q, k, v, None)
    assert torch.allclose(out, plain.attend(1, q, k, v, None))  # the forward is unchanged
    expected = []
    for row, key, start in zip(queries, keys, starts, strict=True):
        scores = k[start:row + 1, 3 // 2] @ q[row, 3] / math.sqrt(d)  # head 3 reads kv head 1; causal, own sequence
        p = scores.softmax(0)
        expected.append(-torch.log(p[key - 1 - start:key + 2 - start].sum()))  # one token either side
    assert float(store.losses[0]) == pytest.approx(float(torch.stack(expected).mean()), rel=1e-5)


def test_guided_loss_falls_when_the_head_looks_there(aligner_script: ModuleType) -> None:
    k = torch.zeros(6, 1, 4)
    k[4, 0, 0] = 5.0  # only row 4's key matches the query
    q = torch.zeros(6, 1, 4)
    q[5, 0, 0] = 5.0
    v = torch.randn(6, 1, 4)
    losses = []
    for target in (4, 1):
        store = aligner_script.GuidedAttentionStore([6], (0,), (0,), [5], [target], [0])
        store.attend(0, q, k, v, None)
        losses.append(float(store.losses[0]))
    assert losses[0] < 0.1 < 2.0 < losses[1]


def _utt(demo_script: ModuleType, seconds: float, text: str, level: float) -> object:
    wave = (np.random.default_rng(1).standard_normal(int(seconds * SR)) * level).astype(np.int16)
    return demo_script.Utt(wave, text, "en-us", [(text[0], 0.1, 0.3)], "sentence")


def test_joined_clips_get_pauses_within_the_limit(demo_script: ModuleType) -> None:
    parts = tuple(_utt(demo_script, s, t, 200.0) for s, t in ((3.0, "one two"), (4.0, "three"), (2.0, "four")))
    assert len(demo_script.join(parts).wave) == 9 * SR  # no gap asked for: back to back
    rng = np.random.default_rng(0)
    longer = 0
    for _ in range(20):
        joined = demo_script.join(parts, rng, max_s=20.0, gap_s=6.0)
        n = len(joined.wave)
        assert 9 * SR <= n <= 20 * SR and joined.text == "one two three four"
        gaps = [joined.phones[i][1] - p for i, p in ((1, 3.1), (2, 7.1))]  # shift beyond the parts' own lengths
        assert gaps[0] >= -1e-9 and gaps[1] >= gaps[0] - 1e-9
        assert math.isclose(gaps[1] * SR, n - 9 * SR, abs_tol=2)  # the shifts add up to the inserted samples
        filler = joined.wave[3 * SR:3 * SR + int(gaps[0] * SR)].astype(np.float32)
        if len(filler) > SR:
            assert 100 < filler.std() < 400  # noise at the level of the clip before it, not silence or a blast
        longer += n > 9 * SR
    assert longer >= 10  # about half the joins get a pause
    capped = demo_script.join(parts, np.random.default_rng(3), max_s=10.0, gap_s=6.0)
    assert len(capped.wave) <= 10 * SR


def test_frequency_warp_moves_energy_and_keeps_its_shape(demo_script: ModuleType) -> None:
    """warp_mel: identity at 1, a peak moves up by the factor (down below 1), the frame count is kept."""
    f = torch.full((128, 7), -1.0)
    f[40] = 1.0
    assert torch.equal(demo_script.warp_mel(f, 1.0), f)
    up, down = demo_script.warp_mel(f, 1.1), demo_script.warp_mel(f, 0.9)
    assert up.shape == down.shape == f.shape
    assert up.argmax(0).tolist() == [44] * 7 and down.argmax(0).tolist() == [36] * 7
    # values are interpolated between neighbours, never invented outside the input's range
    assert float(up.min()) >= -1.0 and float(up.max()) <= 1.0
    # the top bins repeat the last one instead of reading past the spectrogram
    ramp = torch.arange(128, dtype=torch.float32)[:, None].expand(128, 3)
    assert float(demo_script.warp_mel(ramp, 0.9).max()) == 127.0


def test_demo_voices_hold_out_variants_and_keep_the_aligners() -> None:
    """The ASR data trains every accent but never the held-out variants; the aligner's voices stay the first
    recipe's (its bundled model was made with them); every voice named exists in this espeak-ng."""
    data = _script("make_demo_data")
    held_accents = {v.split("+")[0] for v in data.HELD_OUT_VOICES}
    held_variants = {v.split("+")[1] for v in data.HELD_OUT_VOICES}
    assert held_accents <= set(data.TRAIN_ACCENTS)
    assert not held_variants & set(data.TRAIN_VARIANTS)
    assert not held_accents & set(data.FIRST_ACCENTS)  # the aligner's validation voices stay unheard
    assert set(data.FIRST_VARIANTS) <= set(data.TRAIN_VARIANTS)
    espeak = data.Espeak()
    for voice in [*data.TRAIN_ACCENTS, *(f"en+{v}" for v in data.TRAIN_VARIANTS if v), *data.HELD_OUT_VOICES]:
        wave, phones = espeak.synth("nine", voice, 160, 50)
        assert len(wave) > 1600 and phones, voice


def test_word_run_eval_speaks_each_run_by_each_voice(tmp_path: Path) -> None:
    """eval_word_runs --voice: every run by every voice, labelled; without it, the test's voices in turn."""
    evaluate = _script("eval_word_runs")
    assert evaluate.voice_speed("en-gb-x-rp+f2:230") == ("en-gb-x-rp+f2", 230)
    with pytest.raises(Exception, match="VOICE:WPM"):
        evaluate.voice_speed("en-us")
    runs = ["one two", "b four"]
    refs, paths, labels = evaluate.spoken(runs, [("en-us", 175), ("en+m3", 110)], tmp_path)
    assert refs == runs * 2 and labels == ["en-us:175"] * 2 + ["en+m3:110"] * 2
    assert len(set(paths)) == 4 and all(p.stat().st_size > 1000 for p in paths)
    slow, fast = (p.stat().st_size for p in (paths[3], paths[1]))
    assert slow > fast  # 110 wpm lasts longer than 175 wpm
    refs, _, labels = evaluate.spoken(runs, [], tmp_path / "test")
    assert refs == runs and labels == [f"{v}:{s}" for v, s in evaluate.UNSEEN_VOICES[:2]]
