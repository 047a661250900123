"""The streamed transcript text (qasr.server.sse): no prompt preamble leaks, nothing is sent that the
final text takes back, and segments join as join_segment_texts joins them."""

from __future__ import annotations

from qasr.server.sse import Joiner, PieceText
from qasr.transcribe.text import join_segment_texts


def _stream(pieces: list[str], forced: bool = False) -> tuple[list[str], str]:
    """Feed each piece's text one character per 'token' (token k decodes to the piece's k-th character)."""
    joiner, deltas = Joiner(), []
    for raw in pieces:
        chars = list(raw)
        text = PieceText(lambda ids, c=chars: "".join(c[i] for i in ids), forced)
        for k in range(len(chars)):
            first = not text.text
            if d := joiner.add(text.push(k), first_of_piece=first):
                deltas.append(d)
    return deltas, joiner.text


def test_preamble_is_never_streamed() -> None:
    deltas, text = _stream(["language English<asr_text>set an alarm "])
    assert text == "set an alarm" and "language" not in "".join(deltas) and "<asr" not in "".join(deltas)
    assert _stream(["language English"])[1] == ""  # no tag: no transcript at all
    assert _stream([" call anna "], forced=True)[1] == "call anna"


def test_held_back_until_settled() -> None:
    deltas, text = _stream(["language English<asr_text>a  b\ufffd c"])
    assert text == "a  b\ufffd c"  # a replacement char inside the text is kept once followed by more
    assert all(not d.endswith(" ") for d in deltas[:-1] if d.strip())  # trailing spaces wait for the next word


def test_segments_join_like_join_segment_texts() -> None:
    pieces = ["language English<asr_text>one two", "language None<asr_text>", "language English<asr_text>three",
              "language Chinese<asr_text>你好", "language Chinese<asr_text>世界", "language English<asr_text>end"]
    parts = [p.split("<asr_text>", 1)[1] for p in pieces]
    assert _stream(pieces)[1] == join_segment_texts(parts) == "one two three你好世界end"


def test_tokens_in_bursts_give_the_same_text() -> None:
    """Tokens taken several at a time (the stream drains what has arrived) settle the same text as one by one."""
    raw = "language English<asr_text>set an  alarm for six\ufffd forty five "
    chars = list(raw)
    one = PieceText(lambda ids: "".join(chars[i] for i in ids), False)
    burst = PieceText(lambda ids: "".join(chars[i] for i in ids), False)
    singles = "".join(one.push(k) for k in range(len(chars)))
    sizes, k, bursts = [1, 5, 2, 9, 3], 0, []
    while k < len(chars):
        n = sizes[len(bursts) % len(sizes)]
        bursts.append(burst.extend(list(range(k, min(k + n, len(chars))))))
        k += n
    assert "".join(bursts) == singles == one.text == burst.text == "set an  alarm for six\ufffd forty five"
    assert burst.extend([]) == ""


def test_handoff_delivers_in_order_with_one_wakeup_per_burst() -> None:
    """Tokens posted from another thread reach each queue in order, and a burst (one engine step's tokens for
    every stream) costs one loop wake-up. Each step's burst is posted while the loop is held busy, as when it
    lags the engine, so the count is exact whatever the machine's load."""
    import asyncio
    import threading

    from qasr.server.sse import TokenHandoff

    async def main() -> tuple[list[list[int | None]], int]:
        loop = asyncio.get_running_loop()
        handoff = TokenHandoff(loop)
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(8)]
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            nonlocal wakeups
            wakeups += 1
            return real(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]

        def burst(token: int | None) -> None:  # one engine step: a token (or the end marker) for every stream
            engine = threading.Thread(target=lambda: [handoff.post(q, token) for q in queues])
            engine.start()
            engine.join()  # the loop is blocked here: nothing is drained mid-burst

        for step in range(50):
            burst(step)
            await asyncio.sleep(0)  # the loop runs the one drain the burst scheduled
        burst(None)
        got: list[list[int | None]] = []
        for q in queues:
            items = []
            while (t := await q.get()) is not None:
                items.append(t)
            got.append(items + [None])
        return got, wakeups

    got, wakeups = asyncio.run(main())
    assert got == [list(range(50)) + [None]] * 8
    assert wakeups == 51, wakeups  # one per burst; one per token would be 408
