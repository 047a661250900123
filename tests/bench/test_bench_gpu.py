"""The GPU mode of the throughput benchmark (qasr.bench.gpu), checked on CPU: the closed loop's accounting
and time budget, both sides run end to end on a tiny checkpoint, the report. The mode itself runs on a
GPU through scripts/gpu_check.sh."""

from __future__ import annotations

import math
import re
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from qasr.bench.common import closed_loop, percentile
from qasr.bench.gpu import (
    CLIP_RANGE,
    LEVELS,
    GpuPlan,
    gpu_engine_config,
    lengths_for,
    level_with_first_tokens,
    plot,
    run_qasr_gpu,
    run_reference_gpu,
    summary_line,
    table,
)
from qasr.bench.main import main as bench_main
from qasr.model.config import audio_token_count


class FakeEngine:
    """Resolves each request after ``seconds`` on its own thread; records how many ran at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.cancelled = 0

    def submit(self, k: int) -> Future:
        future: Future = Future()
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)

        def finish() -> None:
            time.sleep(self.seconds)
            with self.lock:
                self.running -= 1
            if future.set_running_or_notify_cancel():
                future.set_result(SimpleNamespace(ttft_s=0.01 * (k + 1), latency_s=self.seconds, token_ids=[1] * 3))
            else:
                with self.lock:
                    self.cancelled += 1

        threading.Thread(target=finish, daemon=True).start()
        return future


def test_closed_loop_keeps_c_requests_in_flight_and_counts_what_finished() -> None:
    fake = FakeEngine(0.05)
    lengths = [2.0] * 12
    r = closed_loop(fake.submit, lengths, concurrency=4, budget_s=30)
    assert fake.most == 4 and r["completed"] == 12 and not r["partial"] and r["cancelled"] == 0
    assert r["audio_s"] == 24.0 and r["tokens"] == 36
    assert 0.12 < r["wall_s"] < 2.0 and r["rtfx"] == pytest.approx(24.0 / r["wall_s"])
    assert r["ttft_p50_s"] == pytest.approx(0.06) and r["ttft_p95_s"] == pytest.approx(0.12)
    assert r["rtf_mean"] == pytest.approx(0.05 / 2.0)


def test_closed_loop_stops_at_its_budget_and_cancels_what_still_runs() -> None:
    fake = FakeEngine(1.0)
    t0 = time.perf_counter()
    r = closed_loop(fake.submit, [1.0] * 8, concurrency=8, budget_s=0.3)
    assert time.perf_counter() - t0 < 0.9
    assert r["partial"] and r["completed"] == 0 and r["cancelled"] == 8 and r["audio_s"] == 0
    assert math.isnan(r["ttft_p50_s"])


def test_closed_loop_reports_failing_requests() -> None:
    def submit(k: int) -> Future:
        f: Future = Future()
        if k % 2:
            f.set_exception(ValueError(f"bad {k}"))
        else:
            f.set_result(SimpleNamespace(ttft_s=0.1, latency_s=0.2, token_ids=[1]))
        return f

    r = closed_loop(submit, [1.0] * 6, concurrency=2, budget_s=10)
    assert r["completed"] == 3 and r["error_count"] == 3 and "bad" in r["errors"][0] and r["partial"]


def test_ttft_counts_every_request_including_those_the_budget_cut() -> None:
    """Requests 0 and 1 get their first token after 10 ms and finish; the others have no first token when
    the 0.4 s budget ends. The closed loop's TTFT (completed requests only) says ~10 ms at p95; the level's
    TTFT counts all six, the four still waiting at their wait so far, and says how many those are."""
    def submit(k: int, on_token) -> Future:  # noqa: ANN001 - the engine's on_token
        future: Future = Future()
        t0 = time.perf_counter()

        def work() -> None:
            if k >= 2:
                time.sleep(2.0)  # no first token within the budget
            else:
                time.sleep(0.01)
            on_token(7)
            time.sleep(0.02)
            on_token(None)
            if future.set_running_or_notify_cancel():
                future.set_result(SimpleNamespace(ttft_s=0.01, latency_s=time.perf_counter() - t0, token_ids=[7]))

        threading.Thread(target=work, daemon=True).start()
        return future

    t0 = time.perf_counter()
    lv = level_with_first_tokens(submit, [1.0] * 6, concurrency=4, budget_s=0.4)
    assert time.perf_counter() - t0 < 1.5
    assert lv["partial"] and lv["completed"] == 2
    assert lv["ttft_completed_p95_s"] == pytest.approx(0.01)  # what the level used to report
    assert lv["ttft_requests"] == 6 and lv["ttft_without_first_token"] == 4
    assert lv["ttft_p95_s"] >= 0.3 and lv["ttft_p50_s"] >= 0.3  # four of six waited (nearly) the whole budget


def test_percentile_is_nearest_rank() -> None:
    xs = [float(i) for i in range(1, 21)]
    assert percentile(xs, 0.5) == 10 and percentile(xs, 0.95) == 19 and percentile(xs, 1.0) == 20
    assert percentile([3.0], 0.95) == 3.0 and math.isnan(percentile([], 0.5))


def test_plan_and_engine_settings_fit_the_official_protocol() -> None:
    assert [c for c, _ in LEVELS] == [1, 16, 128, 512]
    assert all(n >= c for c, n in LEVELS if c > 1)  # every client has at least one request
    lengths = lengths_for(200, 0, CLIP_RANGE)
    assert lengths == lengths_for(200, 0, CLIP_RANGE) and 100 <= min(lengths) and max(lengths) <= 140
    cfg = gpu_engine_config(512, None)
    assert cfg.max_running == 512
    # beside 512 decode rows a 140 s clip is encoded in one step and its whole prompt (audio + ~20 text tokens) is
    # one prefill chunk
    audio = audio_token_count(140 * 100)
    assert cfg.step_tokens >= 512 + audio + cfg.prefill_chunk and cfg.prefill_chunk >= audio + 40
    with pytest.raises(ValueError):
        GpuPlan(levels=((1, 1),), level_budgets_s=(1.0, 2.0))


TINY_PLAN = GpuPlan(levels=((1, 2), (4, 4), (8, 8)), level_budgets_s=(120.0, 120.0, 0.0), clip_range=(1.0, 3.0),
                    invariance_clips=3, invariance_range=(1.0, 2.0), invariance_budget_s=60.0,
                    reference_batches=(2, 3), reference_budget_s=120.0, dtype="float32", kv_gib=0.05)


def test_both_sides_run_on_a_tiny_checkpoint_and_the_report_renders(tiny_hf, tmp_path) -> None:
    pytest.importorskip("transformers")
    progress = tmp_path / "qasr.json"
    ours = run_qasr_gpu(tiny_hf, TINY_PLAN, device="cpu", progress=progress)
    assert progress.exists() and '"levels"' in progress.read_text()
    assert ours["skipped_levels"] == [8] and "8" not in ours["levels"]  # a budget of 0 skips a level
    assert ours["config"]["max_running"] == 4  # the largest level that runs
    for conc, n in TINY_PLAN.levels[:2]:
        lv = ours["levels"][str(conc)]
        assert lv["completed"] == n and not lv["partial"] and lv["error_count"] == 0
        # TTFT from the engine's on_token, for every request: all had their first token
        assert lv["ttft_requests"] == n and lv["ttft_without_first_token"] == 0
        assert 0 < lv["ttft_p50_s"] <= lv["ttft_p95_s"] and lv["ttft_completed_p50_s"] > 0
        lengths = lengths_for(n, TINY_PLAN.seed + 100 + TINY_PLAN.levels.index((conc, n)), TINY_PLAN.clip_range)
        assert lv["tokens"] == sum(max(1, round(4 * s)) for s in lengths)  # forced lengths, EOS ignored
        assert lv["rtfx"] > 0 and lv["ttft_p50_s"] <= lv["latency_p50_s"] and lv["steps"] > 0
    inv = ours["invariance"]
    assert inv["compared"] == 3 and 0 <= inv["identical"] <= 3 and len(inv["tokens_per_request"]) == 3
    ref = run_reference_gpu(tiny_hf, TINY_PLAN, device="cpu")
    for batch in TINY_PLAN.reference_batches:
        b = ref["batches"][str(batch)]
        assert b["rtfx"] > 0 and b["tokens"] >= batch
    report = dict(title="tiny", qasr=ours, reference=ref)
    report["qasr"]["levels"]["128"] = dict(ours["levels"]["4"])  # the line reads concurrency 128 and 1
    line = summary_line(report)
    assert re.fullmatch(r"gpu_rtfx_c128=\d+\.\d ttft_p50_c1_ms=\d+\.\d speedup_vs_transformers=\d+\.\d\d", line)
    assert "| qasr | c=1 | 2/2 |" in table(report) and "| transformers generate | batch 3 | 3 |" in table(report)
    pytest.importorskip("matplotlib")
    plot(report, tmp_path / "gpu.png")
    assert (tmp_path / "gpu.png").stat().st_size > 0


def test_summary_line_says_nan_for_what_did_not_run() -> None:
    assert summary_line({}) == "gpu_rtfx_c128=nan ttft_p50_c1_ms=nan speedup_vs_transformers=nan"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without a GPU")
def test_device_cuda_without_a_gpu_says_so(capsys) -> None:
    threads = torch.get_num_threads()
    try:
        assert bench_main(["--device", "cuda"]) == 2
    finally:
        torch.set_num_threads(threads)
    assert "no CUDA device" in capsys.readouterr().out
