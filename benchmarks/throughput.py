"""Throughput benchmark, qasr against transformers side by side: see qasr.bench (also `qasr bench`)."""

from qasr.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
