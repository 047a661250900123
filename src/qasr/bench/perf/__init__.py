"""Performance accounting for the benchmarks: the model's FLOP and memory traffic for a workload
(flops), this machine's measured peaks (machine), and achieved rates per phase against them (roofline)."""
