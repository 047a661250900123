"""Pieces of the side-by-side benchmark that decide what it measures."""

from __future__ import annotations

import math
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest

from qasr.bench.aligner import WORDS_PER_SECOND, agreement, workload
from qasr.bench.cpu import PeakRss, add_quantized_side, clip_lengths, decode_b1_ratio, summary_line
from qasr.bench.perf.flops import (
    PhaseFlops,
    Utterance,
    decode_flops,
    decoder_weight_bytes,
    encoder_flops,
    kv_bytes_per_position,
    prefill_flops,
    workload_flops,
)
from qasr.bench.perf.machine import ForeignCpu, cpu_info, gemm_peak, int8_peak, read_bandwidth
from qasr.bench.perf.phases import ForwardLog, Storage, efficiency_report
from qasr.bench.perf.report import draw_roofline, machine_line, phase_table
from qasr.engine.config import QUANTIZE_MODES
from qasr.model.config import DecoderConfig, EncoderConfig, ModelConfig
from qasr.testing import QWEN3_ASR_0_6B_DIMS, TINY_DIMS


def test_clip_lengths_are_seeded_and_spread_over_2_to_120_s() -> None:
    a, b = clip_lengths(16, seed=0), clip_lengths(16, seed=0)
    assert a == b and a != clip_lengths(16, seed=1)
    assert all(2.0 <= x <= 120.0 for x in a)
    s = sorted(a)
    assert s[0] < 3.0 and s[-1] > 90.0  # stratified: both ends of the range are present


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs")
def test_peak_rss_sees_a_short_lived_allocation() -> None:
    with PeakRss() as quiet:
        pass
    with PeakRss() as busy:
        block = np.ones(200 * 2**20 // 8)  # 200 MiB, touched
        del block
    assert busy.peak - quiet.peak > 150 * 2**20


# ------------------------------------------------------------------------------- efficiency accounting
# A tiny model counted by hand. Encoder: 16 mel bins, 4 conv channels, d 8, 2 layers, ffn 16, output 12,
# 1 s chunks of 100 frames (13 tokens each), 2-chunk windows (26 tokens). Decoder: hidden 8, 2 layers,
# 2 query heads and 1 kv head of 4, ffn 16, vocabulary 50.
TINY_ENC = EncoderConfig(num_mel_bins=16, d_model=8, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=16,
                         output_dim=12, n_window=50, n_window_infer=200, downsample_hidden_size=4)
TINY_DEC = DecoderConfig(vocab_size=50, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4, rope_theta=1e6, rms_norm_eps=1e-6,
                         max_position_embeddings=128, tie_word_embeddings=True)
TINY = ModelConfig(layout="hf", encoder=TINY_ENC, decoder=TINY_DEC, audio_token_id=3, audio_start_token_id=None,
                   audio_end_token_id=None)


def test_encoder_flops_match_a_hand_count() -> None:
    # 250 frames: 3 chunks (the last zero-padded); 13 + 13 + 7 = 33 tokens; windows of 26 and 7 tokens.
    # per chunk: mel 16 -> 8 -> 4 -> 2, frames 100 -> 50 -> 25 -> 13
    conv = 4 * 1 * 9 * 8 * 50 + 4 * 4 * 9 * 4 * 25 + 4 * 4 * 9 * 2 * 13 + 13 * (4 * 2) * 8  # 33376 MAC
    layers = 33 * 2 * (4 * 8 * 8 + 2 * 8 * 16)  # q, k, v, out + fc1, fc2 per token and layer
    projector = 33 * (8 * 8 + 8 * 12)
    attention = 2 * 2 * (26 * 26 + 7 * 7) * 8  # layers x (scores + weighted sum) x window^2 x d
    assert encoder_flops(TINY_ENC, 250) == 2 * (3 * conv + layers + projector + attention)  # 324800


def test_decoder_flops_match_a_hand_count() -> None:
    per_token = 2 * (8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 3 * 8 * 16)  # layers x (q, k, v, o, gate, up, down) = 1152
    lm_head = 8 * 50
    per_position = 2 * 2 * 2 * 4  # layers x (scores + weighted sum) x query heads x head_dim
    # a 5-token prompt: position i attends i + 1 positions (1 + ... + 5 = 15); one logit row (the first token)
    assert prefill_flops(TINY_DEC, 5) == 2 * (5 * per_token + 15 * per_position + lm_head)
    # 3 forced tokens: the first comes from the prefill; 2 decode rows at positions 5 and 6 attend 6 and 7
    assert decode_flops(TINY_DEC, 5, 3) == 2 * (2 * (per_token + lm_head) + 13 * per_position)
    assert decode_flops(TINY_DEC, 5, 1) == 0
    total = workload_flops(TINY, [Utterance(250, 5, 3), Utterance(250, 5, 3)])
    assert total.encoder == 2 * 324800 and total.total == 2 * (324800 + 13280 + 7040)


def test_real_dims_match_the_reference_count() -> None:
    # the published CPU baseline: a 30 s clip (390 audio tokens, 405-token prompt) costs 9.03 GFLOP
    # per audio second in the encoder and 12.53 in the prefill
    dims = {**TINY_DIMS, **QWEN3_ASR_0_6B_DIMS}
    enc = EncoderConfig(num_mel_bins=128, d_model=dims["d_model"], encoder_layers=dims["encoder_layers"],
                        encoder_attention_heads=dims["encoder_attention_heads"],
                        encoder_ffn_dim=dims["encoder_ffn_dim"], output_dim=dims["hidden_size"], n_window=50,
                        n_window_infer=800, downsample_hidden_size=dims["downsample_hidden_size"])
    dec = DecoderConfig(vocab_size=dims["vocab_size"], hidden_size=dims["hidden_size"],
                        intermediate_size=dims["intermediate_size"], num_hidden_layers=dims["num_hidden_layers"],
                        num_attention_heads=dims["num_attention_heads"],
                        num_key_value_heads=dims["num_key_value_heads"], head_dim=dims["head_dim"], rope_theta=1e6,
                        rms_norm_eps=1e-6, max_position_embeddings=65536, tie_word_embeddings=True)
    assert encoder_flops(enc, 3000) / 30e9 == pytest.approx(9.03, abs=0.01)
    assert prefill_flops(dec, 405) / 30e9 == pytest.approx(12.53, abs=0.01)
    assert decoder_weight_bytes(dec) / 1e9 == pytest.approx(1.19, abs=0.01)  # what a decode step streams


def test_machine_probes_are_positive_and_finite_on_tiny_sizes() -> None:
    gemm = gemm_peak(m=8, k=32, n=64, repeats=2)
    assert gemm["best_flops"] == max(gemm["flops"].values())
    assert all(math.isfinite(v) and v > 0 for v in gemm["flops"].values())
    bw = read_bandwidth(nbytes=1 << 20, repeats=2)
    assert math.isfinite(bw) and bw > 0


def test_the_int8_peak_is_the_native_int8_products_rate_or_absent() -> None:
    from qasr.engine.cpu.native import int8_kernel

    peak = int8_peak(m=8, k=64, n=128, repeats=2)
    if int8_kernel() is None:
        assert peak is None  # no int8 module here: no peak is claimed
    else:
        assert peak["shape"] == [8, 64, 128] and math.isfinite(peak["ops"]) and peak["ops"] > 0
        assert peak["kernel"] == getattr(int8_kernel(), "KIND", "int8")


def test_foreign_cpu_is_a_share_between_0_and_1() -> None:
    with ForeignCpu() as others:
        sum(i * i for i in range(200_000))  # our own work is not counted
    assert others.seconds >= 0 and 0 <= others.share <= 1


def test_cpu_info_reads_model_and_bf16_flags(tmp_path) -> None:  # noqa: ANN001 - pytest fixture
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx512f avx512_bf16\n\n"
                    "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert cpu_info(str(fake)) == dict(model="Test CPU 9000", amx_bf16=False, avx512_bf16=True)
    assert cpu_info(str(tmp_path / "missing"))["model"] == "unknown"


def _req(prompt: int, output: int = 0, prefilled: int = 0) -> SimpleNamespace:
    return SimpleNamespace(prompt=[0] * prompt, output=[0] * output, prefilled=prefilled)


def test_forward_log_counts_rows_and_attended_positions() -> None:
    log = ForwardLog()
    a, b = _req(10, output=2), _req(600, prefilled=256)
    log.note(SimpleNamespace(decode=[a], prefill=[(b, 256), (b, 88)]))  # a rides along b's two chunks
    log.note(SimpleNamespace(decode=[a, _req(4, output=1)], prefill=[]))
    assert (log.mixed_forwards, log.decode_forwards) == (1, 1)
    assert (log.ride_rows, log.ride_attended) == (1, 12)
    assert (log.prefill_tokens, log.prefill_kv_read) == (344, 512 + 600)
    assert (log.decode_rows, log.decode_attended) == (2, 12 + 5)


def _fake_run() -> tuple[list[Utterance], PhaseFlops, dict, ForwardLog]:
    """One utterance's workload, its FLOP, phase timings and forward counts, as a side's run reports them."""
    utts = [Utterance(250, 40, 10)]
    log = ForwardLog(encoder_calls=1, mixed_forwards=1, decode_forwards=8, prefill_tokens=40, prefill_kv_read=40,
                     ride_rows=1, ride_attended=41, decode_rows=8, decode_attended=8 * 45)
    timings = dict(features_s=0.1, encoder_s=0.6, forward_mixed_s=1.0, forward_decode_s=2.0, step_s=3.7,
                   prefill_tokens=40, decode_tokens=9)
    return utts, workload_flops(TINY, utts), timings, log


def _fake_efficiency() -> tuple[dict, PhaseFlops]:
    utts, flops, timings, log = _fake_run()
    machine = dict(peak_flops=1e6, bandwidth_Bps=1e8)
    return efficiency_report(TINY, utts, flops, 2.5, 4.0, timings, log, machine, reference_wall_s=8.0), flops


def test_efficiency_is_model_flops_over_wall_over_peak_and_phases_split_the_forwards() -> None:
    eff, flops = _fake_efficiency()
    assert eff["overall"] == pytest.approx(flops.total / 4.0 / 1e6)
    assert eff["reference_overall"] == pytest.approx(eff["overall"] / 2)
    assert eff["flop_per_audio_s"]["total"] == pytest.approx(flops.total / 2.5)
    ph = eff["phases"]
    assert ph["encoder"]["seconds"] == pytest.approx(0.5)  # features are not encoder work
    assert ph["prefill"]["seconds"] + ph["decode"]["seconds"] == pytest.approx(3.0)
    assert 0.5 < eff["mixed_prefill_share"] < 1 and ph["prefill"]["seconds"] < 1.0
    for p in ("encoder", "prefill", "decode"):
        assert ph[p]["efficiency"] == pytest.approx(ph[p]["flop"] / ph[p]["seconds"] / 1e6)
        assert ph[p]["bandwidth_fraction"] == pytest.approx(ph[p]["bytes"] / ph[p]["seconds"] / 1e8)
    assert ph["decode"]["intensity"] < ph["prefill"]["intensity"]  # decode streams the weights per row


def test_last_line_table_and_roofline_render() -> None:
    eff, _ = _fake_efficiency()
    report = dict(speedup=3.0456, qasr=dict(rtfx=9.54), efficiency=eff)
    line = summary_line(report)
    assert re.fullmatch(r"speedup=3\.05 rtfx=9\.5 efficiency=\d+\.\d{3}", line)
    assert float(line.rsplit("=", 1)[1]) == pytest.approx(eff["overall"], abs=5e-4)
    assert "| decode |" in phase_table(eff)
    machine = dict(cpu=dict(model="Test CPU", amx_bf16=False, avx512_bf16=True), threads=2, peak_flops=4e11,
                   bandwidth_Bps=3e10, gemm=dict(shape=[1024, 1024, 3072], flops=dict(torch=4e11)))
    assert machine_line(machine).startswith("machine: Test CPU (no amx_bf16, avx512_bf16), 2 threads")
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    draw_roofline(ax, eff)
    assert len(ax.lines) >= 6  # roof, two guides, three phases
    plt.close(fig)


def test_storage_counts_the_bytes_each_mode_stores() -> None:
    assert Storage.of(2) == Storage(2.0, 2.0, 2.0, quantized=False)
    assert Storage.of(4, kv_cache_dtype="int8", head_dim=64) == Storage(4.0, 4.0, 1.0625, quantized=False,
                                                                         activation=4.0)
    assert Storage.of(2, "int8") == Storage(1.0, 1.0, 2.0, quantized=True)
    assert Storage.of(2, "int8", "int8", 128) == Storage(1.0, 1.0, 1.03125, quantized=True)
    assert Storage.of(2, "int4") == Storage(1.0, 0.53125, 2.0, quantized=True)  # int4 + a float32 scale per 128


def test_a_quantized_side_is_measured_by_its_own_bytes_and_against_the_int8_peak() -> None:
    utts, flops, timings, log = _fake_run()
    machine = dict(peak_flops=1e6, bandwidth_Bps=1e8, int8_peak_ops=2e6)
    bf16 = efficiency_report(TINY, utts, flops, 2.5, 4.0, timings, log, machine)
    st = Storage.of(2, "int8", "int8", TINY.decoder.head_dim)
    int8 = efficiency_report(TINY, utts, flops, 2.5, 4.0, timings, log, machine, storage=st)
    assert "int8_overall" not in bf16 and "int8_efficiency" not in bf16["phases"]["decode"]
    assert int8["overall"] == bf16["overall"]  # the bf16 peak stays the common yardstick
    assert int8["int8_overall"] == pytest.approx(flops.total / 4.0 / 2e6)
    dec, share = TINY.decoder, int8["mixed_prefill_share"]
    want = (decoder_weight_bytes(dec, 1.0) * (8 + (1 - share))
            + kv_bytes_per_position(dec, st.kv_value) * (8 * 45 + 41))
    assert int8["phases"]["decode"]["bytes"] == pytest.approx(want)
    assert int8["phases"]["decode"]["bytes"] < bf16["phases"]["decode"]["bytes"]
    for p in ("encoder", "prefill", "decode"):
        v = int8["phases"][p]
        assert v["int8_efficiency"] == pytest.approx(v["flop"] / v["seconds"] / 2e6)
    table = phase_table(int8)
    assert "| of int8 peak |" in table and "| of int8 peak |" not in phase_table(bf16)
    assert f"{100 * int8['int8_overall']:.1f}%" in table.splitlines()[-3]  # the 'all (wall)' row
    machine_full = dict(cpu=dict(model="Test CPU", amx_bf16=False, avx512_bf16=True), threads=2, peak_flops=4e11,
                        bandwidth_Bps=3e10, gemm=dict(shape=[1024, 1024, 3072], flops=dict(torch=4e11)),
                        int8_gemm=dict(shape=[1024, 1024, 3072], ops=8.1e11, kernel="AVX512-VNNI"))
    assert "int8 GEMM peak 810 GOP/s (AVX512-VNNI)" in machine_line(machine_full)


# ------------------------------------------------------------------------------ --quantize: a quantized side
def _bf16_report(mode: str) -> dict:
    """A bf16 report as run() makes it before a quantized side is added, with the mode's batch-1 figure."""
    eff, _ = _fake_efficiency()
    return dict(title="tiny", reference=dict(rtfx=2.0), qasr=dict(rtfx=10.0, ttft={"1": dict(p50_s=0.1, p95_s=0.2)}),
                speedup=5.0, efficiency=eff, decode_b1={"none": dict(ms_per_token=40.0), mode: dict(ms_per_token=20.0)})


@pytest.mark.parametrize("mode", QUANTIZE_MODES)
def test_a_quantized_side_is_filed_under_its_mode_and_the_last_line_names_it(mode) -> None:  # noqa: ANN001
    report = _bf16_report(mode)
    bf16_line = summary_line(report)
    add_quantized_side(report, mode, dict(rtfx=5.0), dict(overall=0.125))
    assert report[f"qasr_{mode}"] == dict(rtfx=5.0) and report["title"] == f"tiny; and qasr {mode}"
    assert report[mode] == {"speedup": 2.5, f"{mode}_over_bf16": 0.5, "efficiency": dict(overall=0.125),
                            "decode_b1_over_bf16": 0.5}
    assert not {m for m in QUANTIZE_MODES if m != mode} & set(report)  # no other mode's keys
    # the format scripts and docs read (int8's exactly as before int4 came)
    assert summary_line(report) == f"speedup=2.50 rtfx=5.0 efficiency=0.125 {mode}_over_bf16=0.50"
    # run()'s "bf16: ..." line, printed just before: the report without the mode's figures
    assert summary_line({k: v for k, v in report.items() if k != mode}) == bf16_line


def test_decode_at_batch_1_is_compared_round_by_round() -> None:
    """Each round's quantized run over the bf16 run beside it, the median of those: here the machine slowed 2x in
    the third round, which moves the sides' medians apart (25 / 40 = 0.625) but not any round's own ratio."""
    decode_b1 = {"none": dict(ms_per_token=40.0, runs_ms=[30.0, 32.0, 60.0, 40.0, 62.0]),
                 "int8": dict(ms_per_token=25.0, runs_ms=[15.0, 17.6, 30.0, 25.0, 31.0])}
    got = decode_b1_ratio(decode_b1, "int8")
    assert got["decode_b1_over_bf16_by_round"] == pytest.approx([0.5, 0.55, 0.5, 0.625, 0.5])
    assert got["decode_b1_over_bf16"] == pytest.approx(0.5)
    assert got["decode_b1_over_bf16_of_medians"] == pytest.approx(0.625)
    # a report without the rounds' runs keeps the ratio of the medians
    assert decode_b1_ratio({"none": dict(ms_per_token=40.0), "int8": dict(ms_per_token=25.0)}, "int8") == {
        "decode_b1_over_bf16": 0.625}


@pytest.mark.parametrize("mode", QUANTIZE_MODES)
def test_the_plot_draws_the_quantized_bar_under_its_mode(tmp_path, mode) -> None:  # noqa: ANN001
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qasr.bench.cpu import plot

    report = _bf16_report(mode)
    add_quantized_side(report, mode, dict(rtfx=5.0), dict(overall=0.125))
    plot(report, tmp_path / "throughput.png")
    bars = plt.gcf().axes[0]
    assert [t.get_text() for t in bars.get_xticklabels()] == ["transformers (batch 8)", "qasr", f"qasr {mode}"]
    assert bars.get_title() == f"throughput, qasr bf16 x5.00, {mode} x2.50"
    plt.close("all")
    assert (tmp_path / "throughput.png").stat().st_size > 0


@pytest.mark.parametrize("mode", QUANTIZE_MODES)
def test_bench_refuses_a_quantized_gpu_run_naming_the_mode(capsys, mode) -> None:  # noqa: ANN001
    import torch

    from qasr.bench.main import main as bench_main

    with pytest.raises(SystemExit):  # refused, not ignored: the quantized paths run on the CPU only
        # --threads: main sets torch's thread count, and this process's must stay what conftest set
        bench_main(["--device", "cuda", "--quantize", mode, "--threads", str(torch.get_num_threads())])
    assert f"--quantize {mode} is for the CPU throughput mode (qasr's {mode} path" in capsys.readouterr().err


def test_rounds_report_every_pair_and_their_median_as_the_ratio() -> None:
    from qasr.bench.cpu import add_rounds, side_pair

    report = _bf16_report("int8")
    add_quantized_side(report, "int8", dict(rtfx=15.0, wall_s=30.0), dict(overall=0.5))  # first round: 1.5
    rounds = [side_pair(dict(wall_s=45.0, rtfx=10.0), dict(wall_s=30.0, rtfx=15.0)),
              side_pair(dict(wall_s=50.0, rtfx=9.0), dict(wall_s=28.0, rtfx=16.2)),
              side_pair(dict(wall_s=44.0, rtfx=10.2), dict(wall_s=31.0, rtfx=14.28))]
    assert rounds[0] == dict(bf16_wall_s=45.0, quantized_wall_s=30.0, ratio=1.5)
    add_rounds(report, "int8", rounds)
    assert report["rounds"] == rounds
    assert report["int8"]["int8_over_bf16_first"] == 1.5
    assert report["int8"]["int8_over_bf16"] == pytest.approx(1.5)  # the median of 1.5, 1.8, 1.4
    assert summary_line(report).endswith("int8_over_bf16=1.50")


def test_bench_refuses_rounds_without_a_quantized_side(capsys) -> None:  # noqa: ANN001
    import torch

    from qasr.bench.main import main as bench_main

    for argv in (["--rounds", "3"], ["--rounds", "0", "--quantize", "int8"]):
        with pytest.raises(SystemExit):
            bench_main([*argv, "--threads", str(torch.get_num_threads())])
        assert "--rounds N (N >= 1) compares the two qasr sides" in capsys.readouterr().err


def test_bench_runs_an_int4_side_on_a_tiny_checkpoint(tiny_original) -> None:  # noqa: ANN001
    """run() passes the mode to both measurements; here they run in this process on int4 (int8's twin is in
    test_int8_mode.py)."""
    from qasr.bench.common import make_clip
    from qasr.bench.cpu import Workload, measure_decode_batch1, run_qasr

    clips = [make_clip(s, k) for k, s in enumerate((1.5, 2.5))]
    side = run_qasr(tiny_original, clips, Workload((), ((1, 1),), (1.0, 1.5)), kv_gib=0.05, seed=0, quantize="int4")
    assert "int4" in side["kernels"] and side["tokens"] > 0
    b1 = measure_decode_batch1(tiny_original, (None, "int4"), rounds=1)
    assert set(b1) == {"none", "int4"} and all(v["ms_per_token"] > 0 for v in b1.values())


# ------------------------------------------------------------------------------------------ aligner mode
def test_aligner_workload_is_seeded_2_to_60_s_at_2_5_words_per_second() -> None:
    lengths, clips, texts = workload(12, seed=0)
    again = workload(12, seed=0)
    assert lengths == again[0] and texts == again[2]
    assert all(np.array_equal(a, b) for a, b in zip(clips, again[1], strict=True))
    assert texts != workload(12, seed=1)[2]
    assert all(2.0 <= s <= 60.0 for s in lengths) and min(lengths) < 3.0 and max(lengths) > 45.0
    for s, wave, text in zip(lengths, clips, texts, strict=True):
        assert len(wave) == int(s * 16000)
        assert len(text.split()) == max(1, round(WORDS_PER_SECOND * s))


def test_aligner_agreement_counts_equal_and_near_words_and_whole_clips_that_differ() -> None:
    ours = [[(0.0, 0.08), (0.16, 0.24)], [(1.0, 1.0)], [(2.0, 2.0), (3.0, 3.0)]]
    ref = [[(0.0, 0.08), (0.24, 0.24)], [(1.0, 1.5)], [(2.0, 2.0)]]  # the last clip's word lists differ
    ag = agreement(ours, ref)
    assert ag["words"] == 5 and ag["clips"] == 3
    assert ag["exact"] == pytest.approx(1 / 5) and ag["within_80ms"] == pytest.approx(2 / 5)
    assert ag["distinct_starts"] == 3


def test_aligner_sides_run_and_agree_in_float32_on_a_tiny_checkpoint(tmp_path) -> None:  # noqa: ANN001
    """Both sides of the aligner mode, in this process, at tiny dims: the reference's batching (sorted,
    left padding, attention mask) gives qasr's word times in float32; then the report renders."""
    pytest.importorskip("transformers")
    import torch

    from qasr.bench.aligner import build_aligner_checkpoint, plot, run_qasr_aligner, run_reference_aligner, table
    from qasr.bench.aligner import summary_line as aligner_line

    ckpt = build_aligner_checkpoint(tmp_path, dims=TINY_DIMS, dtype=torch.float32)
    _, clips, texts = workload(3, seed=2)
    ours = run_qasr_aligner(ckpt, clips, texts, kv_gib=0.05, dtype="float32")
    ref = run_reference_aligner(ckpt, clips, texts, batch=2, dtype="float32")
    ag = agreement(ours["words"], ref["words"])
    assert ag["distinct_starts"] > 3  # the decorrelated head gives varied times: the check means something
    # equal here; a near-tie between two of the 5000 random classes may flip on other CPUs' float32 sums,
    # while a padding or masking mistake would move most words
    assert ag["exact"] >= 0.95 and ag["words"] >= 60
    report = dict(title="tiny", qasr=ours, reference=ref, speedup=ours["rtfx"] / ref["rtfx"], agreement=ag)
    assert re.fullmatch(r"aligner_speedup=\d+\.\d\d aligner_rtfx=\d+\.\d", aligner_line(report))
    assert "| qasr Aligner.submit_pieces | 3 |" in table(report)
    pytest.importorskip("matplotlib")
    plot(report, tmp_path / "aligner.png")
    assert (tmp_path / "aligner.png").stat().st_size > 0
