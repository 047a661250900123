"""Text and plot forms of the efficiency report: the machine line, the phase table, the roofline."""

from __future__ import annotations

import numpy as np

from qasr.bench.perf.phases import PHASES


def machine_line(machine: dict) -> str:
    cpu, gemm = machine["cpu"], machine["gemm"]
    feats = ", ".join(f"{'' if cpu[f] else 'no '}{f}" for f in ("amx_bf16", "avx512_bf16"))
    rates = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in gemm["flops"].items())
    m, k, n = gemm["shape"]
    int8 = machine.get("int8_gemm")
    int8_part = f", int8 GEMM peak {int8['ops'] / 1e9:.0f} GOP/s ({int8['kernel']})" if int8 else ""
    return (f"machine: {cpu['model']} ({feats}), {machine['threads']} threads: bf16 GEMM peak "
            f"{machine['peak_flops'] / 1e9:.0f} GFLOP/s ({m}x{k}x{n}; {rates}){int8_part}, "
            f"read bandwidth {machine['bandwidth_Bps'] / 1e9:.1f} GB/s")


def phase_table(eff: dict) -> str:
    """qasr's phases against the machine: model FLOP, achieved rates, their fractions of the peaks."""
    int8 = "int8_overall" in eff
    extra = (" of int8 peak |", "---|") if int8 else ("", "")
    rows = ["| qasr phase | seconds | GFLOP per audio s | GFLOP/s | of bf16 peak |" + extra[0]
            + " FLOP/byte | GB/s | of bandwidth |", "|---|---|---|---|---|" + extra[1] + "---|---|---|"]
    for p in PHASES:
        v = eff["phases"][p]
        of_int8 = f" {100 * v['int8_efficiency']:.1f}% |" if int8 else ""
        rows.append(f"| {p} | {v['seconds']:.1f} | {eff['flop_per_audio_s'][p] / 1e9:.2f} | {v['flops'] / 1e9:.0f} | "
                    f"{100 * v['efficiency']:.1f}% |{of_int8} {v['intensity']:.1f} | {v['bandwidth_Bps'] / 1e9:.1f} | "
                    f"{100 * v['bandwidth_fraction']:.0f}% |")
    total = eff["flop_per_audio_s"]["total"] / 1e9
    of_int8 = f" {100 * eff['int8_overall']:.1f}% |" if int8 else ""
    rows.append(f"| all (wall) | | {total:.2f} | | {100 * eff['overall']:.1f}% |{of_int8} | | |")
    rows.append(f"\nmixed forwards: {100 * eff['mixed_prefill_share']:.1f}% of their seconds and weight traffic to "
                f"prefill (by FLOP share), the rest to the decode rows riding along")
    return "\n".join(rows)


def draw_roofline(ax, eff: dict) -> None:  # noqa: ANN001 - a matplotlib Axes
    """Arithmetic intensity vs achieved FLOP/s, one point per phase, under the machine's GEMM peak and
    read bandwidth."""
    peak, bw = eff["peak_flops"], eff["bandwidth_Bps"]
    pts = {p: eff["phases"][p] for p in PHASES}
    lo = min(0.3, *(v["intensity"] / 3 for v in pts.values()))
    hi = max(3 * peak / bw, *(v["intensity"] * 3 for v in pts.values()))
    xs = np.geomspace(lo, hi, 200)
    ax.plot(xs, np.minimum(peak, bw * xs) / 1e9, "k-", lw=1.5)
    ax.axhline(peak / 1e9, color="k", ls=":", lw=0.8)
    ax.plot(xs, bw * xs / 1e9, color="k", ls=":", lw=0.8)
    ax.text(hi, peak / 1e9 * 1.08, f"bf16 GEMM peak {peak / 1e9:.0f} GFLOP/s", ha="right", fontsize=8)
    ridge = peak / bw
    ax.text(ridge / 6, bw * ridge / 6 / 1e9 * 2.2, f"read {bw / 1e9:.1f} GB/s", fontsize=8, ha="right")
    colors = dict(encoder="#d95f02", prefill="#7570b3", decode="#1b9e77")
    for name, v in pts.items():
        label = f"{name}: {100 * v['efficiency']:.0f}% of peak, {100 * v['bandwidth_fraction']:.0f}% of bandwidth"
        ax.plot(v["intensity"], v["flops"] / 1e9, "o", ms=8, color=colors[name], label=label)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    low = min(v["flops"] for v in pts.values())
    ax.set_ylim(min(low, bw * lo) / 3e9, 3 * peak / 1e9)
    ax.set_xlabel("arithmetic intensity (model FLOP per byte moved, at least)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title(f"qasr roofline: efficiency {100 * eff['overall']:.0f}% of peak overall")
