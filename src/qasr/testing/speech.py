"""Synthetic speech in real container formats, by the espeak-ng and ffmpeg command-line tools."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

# encoder arguments by output extension
_CODEC_ARGS: dict[str, list[str]] = {
    ".wav": ["-c:a", "pcm_s16le"],
    ".flac": ["-c:a", "flac"],
    ".mp3": ["-c:a", "libmp3lame", "-q:a", "4"],
    ".ogg": ["-c:a", "libvorbis", "-q:a", "4"],
    ".opus": ["-c:a", "libopus", "-b:a", "48k"],
    ".m4a": ["-c:a", "aac", "-b:a", "96k"],
    ".webm": ["-c:a", "libopus", "-b:a", "48k"],
}


def speak(
    text: str, path: str | os.PathLike, voice: str = "en-us", speed: int = 160, pitch: int = 50
) -> Path:
    """``text`` spoken by espeak-ng into a WAV file at ``path`` (on stdin: never read as an option)."""
    exe = _require("espeak-ng")
    out = Path(path)
    cmd = [exe, "-v", voice, "-s", str(speed), "-p", str(pitch), "-w", str(out), "--stdin"]
    _run(cmd, input_text=text)
    return out


def convert(src_wav: str | os.PathLike, dst_path: str | os.PathLike, codec: str | None = None) -> Path:
    """``src_wav`` transcoded by ffmpeg, the encoder by the extension unless ``codec`` names one."""
    exe = _require("ffmpeg")
    dst = Path(dst_path)
    suffix = dst.suffix.lower()
    if codec is not None:
        codec_args = ["-c:a", codec]
    elif suffix in _CODEC_ARGS:
        codec_args = _CODEC_ARGS[suffix]
    else:
        raise ValueError(f"convert: unsupported output extension {suffix!r} (known: {sorted(_CODEC_ARGS)})")
    _run([exe, "-y", "-loglevel", "error", "-i", str(src_wav), "-vn", *codec_args, str(dst)])
    return dst


def _require(tool: str) -> str:
    exe = shutil.which(tool)
    if exe is None:
        raise RuntimeError(f"{tool} is not installed or not on PATH; it is needed to generate test audio")
    return exe


def _run(cmd: list[str], input_text: str | None = None) -> None:
    result = subprocess.run(cmd, input=input_text, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed (exit {result.returncode}): {result.stderr.strip()}")
