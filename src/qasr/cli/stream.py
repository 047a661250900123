"""``qasr stream FILE|mic --server URL``: play audio into a running ``qasr serve`` in real time and print
the live transcript: on a terminal the open turn redrawn in place, piped the finished turns (``--partials``:
every update, ``--json``: every event). The first Ctrl-C ends the input, a second quits at once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Iterable
from dataclasses import asdict
from types import FrameType
from typing import TYPE_CHECKING, TextIO

from qasr.cli.argtypes import positive_float, positive_int

if TYPE_CHECKING:  # the client (and numpy, the decoders) load only when streaming
    from qasr.cli.stream_client import Capture

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 0, 1, 2, 130, 141
GREY, RESET, CLEAR_LINE = "\033[90m", "\033[0m", "\r\033[K"


def add_stream_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    s = subparsers.add_parser(
        "stream", help="live transcription of a file (played in real time) or a microphone, through a server",
        description="Send audio to a running `qasr serve` over a WebSocket as it is spoken and print the live "
                    "transcript. INPUT is an audio file, played at --speed x real time, or 'mic' to capture "
                    "with ffmpeg (--mic-format, --mic-device).")
    s.add_argument("input", metavar="INPUT", help="an audio file, or 'mic'")
    s.add_argument("--server", default="http://127.0.0.1:8000", help="the server's URL (default http://127.0.0.1:8000)")
    s.add_argument("--protocol", choices=("native", "openai"), default="native",
                   help="native: /v1/stream (raw PCM); openai: /v1/realtime (OpenAI Realtime events)")
    s.add_argument("--language", default=None, help="force a language (default: detected)")
    s.add_argument("--no-turn-detection", action="store_true",
                   help="one turn for the whole input instead of turns cut at pauses by the server's VAD")
    s.add_argument("--speed", type=_non_negative, default=1.0,
                   help="playback speed of a file: 1 = real time (default), 0 = as fast as the server takes it "
                        "(the client waits on the server's backlog: no audio is dropped)")
    s.add_argument("--chunk-ms", type=positive_int, default=100, help="audio per message in ms (default 100)")
    s.add_argument("--mic-format", default="pulse" if sys.platform.startswith("linux") else "avfoundation",
                   help="ffmpeg input format for 'mic' (pulse, alsa, avfoundation, dshow, lavfi, ...)")
    s.add_argument("--mic-device", default="default", help="ffmpeg input device for 'mic' (default: 'default')")
    s.add_argument("--api-key", default=None, help="the server's API key (default: $QASR_API_KEY)")
    s.add_argument("--keepalive", type=positive_float, default=20.0, metavar="SECONDS",
                   help="ping the server this often; one that has not answered a ping within as long is taken "
                        "as gone (default 20). There is no other timeout: silence and a busy server are waited for")
    s.add_argument("--partials", action="store_true", help="when piped, also print every partial update")
    s.add_argument("--json", action="store_true", help="print the events as JSON lines")
    return s


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def stream_command(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from websockets.exceptions import WebSocketException

    from qasr.audio.io import AudioError
    from qasr.cli.stream_client import Capture, file_chunks

    capture: Capture | None = None
    if args.input == "mic":
        try:
            chunks = capture = Capture(args.mic_format, args.mic_device, args.chunk_ms)
        except RuntimeError as exc:  # no ffmpeg
            print(f"qasr stream: error: {exc}", file=sys.stderr)
            return EXIT_FAILED
    else:
        if not os.path.isfile(args.input):
            print(f"qasr stream: error: no such file: {args.input}", file=sys.stderr)
            return EXIT_USAGE
        try:  # decoded before connecting: a file that is not audio fails now
            chunks = file_chunks(args.input, args.chunk_ms)
        except AudioError as exc:
            print(f"qasr stream: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt:  # while a long file decodes
            return EXIT_INTERRUPTED
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, _first_interrupt(stop, capture))
    try:
        failed = _print_events(args, chunks, stop, out)
    except KeyboardInterrupt:  # the second Ctrl-C
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout closed early (`| head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (OSError, RuntimeError, ValueError, TimeoutError, WebSocketException) as exc:
        print(f"qasr stream: error: {_describe(exc)}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        signal.signal(signal.SIGINT, previous)
        if capture is not None:
            capture.stop()
    if stop.is_set():
        return EXIT_INTERRUPTED
    return EXIT_FAILED if failed else EXIT_OK


def _first_interrupt(stop: threading.Event, capture: Capture | None):  # noqa: ANN202
    """The first Ctrl-C ends the input (the transcript of what was sent still comes); the next raises."""

    def handler(sig: int, frame: FrameType | None) -> None:
        stop.set()
        if capture is not None:
            capture.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # os.write: a print here could re-enter a print the main thread is in
        os.write(2, b"qasr stream: input ended; waiting for the last transcript (Ctrl-C again quits now)\n")

    return handler


def _print_events(args: argparse.Namespace, chunks: Iterable[bytes], stop: threading.Event, out: TextIO) -> bool:
    """Stream and print; True when the server reported an error."""
    from qasr.cli.stream_client import Final, Partial, ServerError, stream

    live = out.isatty() and not args.json
    failed = False
    for event in stream(chunks, args.server, args.protocol, args.language, not args.no_turn_detection,
                        args.speed, args.api_key or os.environ.get("QASR_API_KEY"), keepalive_s=args.keepalive,
                        stop=stop):
        if args.json:
            print(json.dumps({"event": type(event).__name__.lower(), **asdict(event)}, ensure_ascii=False),
                  file=out, flush=True)
        elif isinstance(event, Partial):
            if live:
                print(f"{CLEAR_LINE}{event.stable}{GREY}{event.unstable}{RESET}", end="", file=out, flush=True)
            elif args.partials:
                print(f"~ {event.stable}|{event.unstable}", file=out, flush=True)
        elif isinstance(event, Final):
            print(f"{CLEAR_LINE if live else ''}{_times(event)}{event.text}", file=out, flush=True)
        if isinstance(event, ServerError):
            failed = True
            print(f"qasr stream: server error {event.code}: {event.message}", file=sys.stderr)
    return failed


def _describe(exc: BaseException) -> str:
    from websockets.exceptions import ConnectionClosedError

    if isinstance(exc, ConnectionClosedError) and exc.rcvd is None:
        return f"the connection to the server was lost ({exc})"
    return f"{type(exc).__name__}: {exc}"


def _times(event: object) -> str:
    start, end = getattr(event, "start", None), getattr(event, "end", None)
    if start is None or end is None:
        return ""
    return f"[{_clock(start)} -> {_clock(end)}] "


def _clock(seconds: float) -> str:
    minutes, secs = divmod(seconds, 60)
    return f"{int(minutes)}:{secs:05.2f}"
