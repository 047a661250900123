"""The per-step bookkeeping of the official algorithm, independent of how audio is encoded."""

from __future__ import annotations

from dataclasses import dataclass, field

from qasr.streaming.config import StreamConfig
from qasr.streaming.text import PromptBuilder, encode_raw, rollback


@dataclass(frozen=True)
class StepResult:
    """One decode of the stream: what was fed (all the samples so far, the answer's start) and what came out."""

    index: int
    samples: int
    prefix: str
    prompt: tuple[int, ...]
    generated: tuple[int, ...]  # EOS excluded
    raw: str  # prefix + decoded generation
    language: str
    text: str
    final: bool


@dataclass
class StreamText:
    """The last raw output and its parse; decides each step's prefix."""

    config: StreamConfig
    prompts: PromptBuilder
    chunk_id: int = 0
    raw: str = ""
    language: str = ""
    text: str = ""
    record: bool = True  # keep every step's result; else only the last
    steps: int = 0
    results: list[StepResult] = field(default_factory=list)

    def prefix(self, at_finish: bool = False) -> str:
        if self.chunk_id < self.config.unfixed_chunk_num:
            return ""
        p = self.prompts
        return rollback(p.tokenizer, p.special, self.raw, self.config.unfixed_token_num, at_finish=at_finish)

    def guess(self, prefix: str) -> list[int]:
        """The ids the last output has beyond ``prefix``: what the step likely generates first (a draft)."""
        if not self.raw:
            return []
        p = self.prompts
        ids = encode_raw(p.tokenizer, p.special, self.raw)
        head = encode_raw(p.tokenizer, p.special, prefix) if prefix else []
        return ids[len(head):] if ids[:len(head)] == head else []

    def absorb(self, samples: int, prefix: str, prompt: list[int], generated: list[int], final: bool) -> StepResult:
        """Take one step's output."""
        self.raw = prefix + self.prompts.tokenizer.decode(generated)
        self.language, self.text = self.prompts.parse(self.raw)
        step = StepResult(self.steps, samples, prefix, tuple(prompt), tuple(generated), self.raw,
                          self.language, self.text, final)
        if not self.record:
            self.results.clear()
        self.results.append(step)
        self.steps += 1
        self.chunk_id += 1
        return step
