"""Performance accounting for the benchmarks: model FLOP and traffic (flops), the machine's peaks
(machine), achieved rates per phase against them (phases, report)."""
