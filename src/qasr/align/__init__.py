"""The forced aligner (docs/aligner.md)."""
