"""``qasr serve``: its arguments, and running the server until SIGTERM/SIGINT (docs/server.md). Only
argparse loads at import time."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from qasr.cli.argtypes import add_engine_flags, engine_spec, positive_float, positive_int

if TYPE_CHECKING:
    from qasr.server.config import ServerConfig

DEFAULT_MODEL = "Qwen/Qwen3-ASR-0.6B"


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    s = subparsers.add_parser(
        "serve", help="serve an OpenAI-compatible transcription API (needs the server extra)",
        usage="%(prog)s [MODEL] [options]",
        description="Serve POST /v1/audio/transcriptions (OpenAI-compatible), /v1/models, /health, /metrics and "
                    "a web page at /. One model is loaded and shared by every request. SIGTERM or Ctrl-C: new "
                    "requests get 503 while the accepted ones (live sessions included) finish, for at most "
                    "--drain-timeout seconds; then the server exits: 0 when everything finished, 1 when the "
                    "deadline cut requests short (they get an error) or a second signal stopped it at once.")
    s.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help=f"checkpoint directory or hub id, as in 'vllm serve MODEL' (default {DEFAULT_MODEL})")
    s.add_argument("-m", "--model", default=None, help="the same as MODEL")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but / and /health "
                        "(default: the QASR_API_KEY environment variable; none: no authentication)")
    s.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="a model id for /v1/models (repeatable; default: the -m value and its last path part); "
                        "requests may name any model")
    s.add_argument("--max-queue-audio-s", type=positive_float, default=3600.0, metavar="S",
                   help="audio seconds admitted and not yet transcribed beyond which requests get 429 (default 3600)")
    s.add_argument("--max-upload-mb", type=positive_float, default=100.0, metavar="MB",
                   help="largest upload in MiB; larger ones get 413 (default 100)")
    s.add_argument("--aligner", default=None, metavar="PATH",
                   help="a Qwen3-ForcedAligner directory or hub id, loaded beside the model: enables "
                        "timestamp_granularities[]=word (default: none; word timestamps are refused)")
    add_engine_flags(s)
    s.add_argument("--decode-workers", type=positive_int, default=4, metavar="N",
                   help="threads that probe and decode uploads (default 4); more uploads wait their turn, and "
                        "live sessions run on threads of their own")
    s.add_argument("--max-live-sessions", type=positive_int, default=64, metavar="N",
                   help="live WebSocket sessions (/v1/realtime, /v1/stream) open at once (default 64)")
    s.add_argument("--live-idle-timeout-s", type=positive_float, default=60.0, metavar="S",
                   help="close a live session that sends nothing for this long (default 60)")
    s.add_argument("--live-max-backlog-s", type=positive_float, default=30.0, metavar="S",
                   help="audio a live session may have waiting; past it the server reads no more of the "
                        "connection until some is processed (the client's sends wait in TCP) (default 30)")
    s.add_argument("--ws-ping-interval", type=positive_float, default=20.0, metavar="S",
                   help="ping WebSocket clients this often, which keeps idle connections open through proxies "
                        "(default 20); a late answer never closes a connection (see docs/server.md)")
    s.add_argument("--live-chunk-s", type=positive_float, default=1.0, metavar="S",
                   help="audio per live decoding step, from 0.25 to 30 (default 1.0; the official default is 2.0)")
    s.add_argument("--live-end-on-chunk", choices=("on", "off"), default="off",
                   help="on: a live turn that a pause ends takes the silence up to its chunk boundary, so no push "
                        "runs two decoding steps (best for one session on a small machine); off (the default): it "
                        "ends at the pause, which did better with many sessions sharing the engine "
                        "(docs/streaming.md); /v1/stream's start message may set end_on_chunk per session")
    s.add_argument("--engine-timeout-s", type=positive_float, default=60.0, metavar="S",
                   help="an engine that has work in hand and finishes no step for this long makes /health answer "
                        "503, and a live session whose engine request goes unanswered this long ends with an "
                        "error, freeing its place (default 60)")
    s.add_argument("--drain-timeout", type=positive_float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/Ctrl-C, how long accepted requests and live sessions may take to finish; "
                        "past it they end with a 'shutting_down' error and the server exits 1 (default 30)")
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    from qasr.cli.ray_options import add_serve_options  # argparse only: nothing heavy loads

    add_serve_options(s)
    return s




def resolve_model(args: argparse.Namespace) -> str | None:
    """Set ``args.model`` from MODEL or ``-m`` (the default without either); the problem when both differ."""
    given = {m for m in (args.model_arg, args.model) if m is not None}
    if len(given) > 1:
        return f"MODEL {args.model_arg!r} and --model {args.model!r} differ: give the model once"
    args.model = given.pop() if given else DEFAULT_MODEL
    return None


def _served_names(args: argparse.Namespace) -> tuple[str, ...]:
    if args.served_model_name:
        return tuple(dict.fromkeys(args.served_model_name))
    return tuple(dict.fromkeys([args.model, Path(args.model.rstrip("/")).name]))


def server_config(args: argparse.Namespace) -> ServerConfig:
    from qasr.server.config import ServerConfig

    problem = resolve_model(args)
    if problem is not None:
        raise ValueError(problem)
    return ServerConfig(model=args.model, served_names=_served_names(args),
                        api_key=args.api_key or os.environ.get("QASR_API_KEY") or None,
                        max_queue_audio_s=args.max_queue_audio_s,
                        max_upload_bytes=int(args.max_upload_mb * 2**20), aligner=args.aligner,
                        max_live_sessions=args.max_live_sessions, live_idle_timeout_s=args.live_idle_timeout_s,
                        live_max_backlog_s=args.live_max_backlog_s, live_chunk_s=args.live_chunk_s,
                        live_end_on_chunk=args.live_end_on_chunk == "on",
                        drain_timeout_s=args.drain_timeout, decode_workers=args.decode_workers,
                        engine_timeout_s=args.engine_timeout_s)


def serve_command(args: argparse.Namespace) -> int:
    problem = resolve_model(args)
    if problem is None and args.threads is not None and args.ray is not None:
        problem = "--threads sets this machine's engine; with --ray, --ray-replica-cpus sets each replica's threads"
    if problem is not None:
        print(f"qasr serve: error: {problem}", file=sys.stderr)
        return 2
    try:
        import uvicorn

        from qasr.server.app import create_app
    except ImportError as exc:
        print(f"qasr: error: the server needs its extra: pip install 'qasr[server]' ({exc})", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        config = server_config(args)
    except ValueError as exc:
        print(f"qasr serve: error: {exc}", file=sys.stderr)
        return 2
    if args.ray is not None:  # replicas of this same app on a Ray cluster
        from qasr.distributed.commands import serve_on_ray

        return serve_on_ray(args, config)

    from qasr.engine_process.asr import start_asr

    # the engines run in a process of their own, started in a worker thread once the server listens
    app = create_app(config, lambda: start_asr(engine_spec(args, args.aligner), config.engine_timeout_s))
    # qasr's access log, not uvicorn's (which prints query strings). No pong timeout: a throttled live
    # client's pong waits in TCP behind its audio; a client that left is closed by --live-idle-timeout-s.
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, access_log=False,
                                           log_level=args.log_level, timeout_graceful_shutdown=5,
                                           ws_ping_interval=args.ws_ping_interval, ws_ping_timeout=None))
    state = app.state.qasr
    state.on_drained = lambda: setattr(server, "should_exit", True)
    stopped_at_once: list[int] = []  # a second signal came

    def on_signal(sig: int, frame: FrameType | None) -> None:
        """First signal: drain, then exit. Second: stop now."""
        if state.draining:
            stopped_at_once.append(sig)
            server.should_exit = True
            server.force_exit = True
            return
        logging.getLogger("qasr.server").info(
            "%s: finishing %d accepted requests and live sessions (at most %g s), refusing new ones",
            signal.Signals(sig).name, state.in_flight, config.drain_timeout_s)
        state.start_drain()

    # ours drains first and does not re-raise the signal, so a drained server exits 0
    server.handle_exit = on_signal  # type: ignore[method-assign]
    server.run()
    return 1 if stopped_at_once or state.drain_cut.is_set() else 0
