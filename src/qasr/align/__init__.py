"""Qwen3-ForcedAligner: word and character timestamps for a known transcript (see docs/aligner.md)."""
