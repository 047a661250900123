"""The upload size limit, enforced while the body is read (never after buffering it), and the uploaded
file as an input the decoders read in place.
"""

from __future__ import annotations

from typing import IO

from starlette.datastructures import UploadFile
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qasr.audio.io import EncodedAudio
from qasr.server.errors import error_response


class UploadTooLarge(Exception):
    """Raised from ``receive`` inside the form parser once the body passes the limit."""


def too_large_message(limit: int) -> str:
    return f"the upload is larger than this server's limit of {limit / 2**20:g} MB (--max-upload-mb)"


class UploadLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"").strip()
        if declared.isdigit() and int(declared) > self.max_bytes:
            # answered before reading the body (uvicorn discards the rest), so the client reads the 413
            await error_response(413, too_large_message(self.max_bytes), param="file",
                                 code="file_too_large")(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise UploadTooLarge(too_large_message(self.max_bytes))
            return message

        await self.app(scope, counting_receive, send)


def upload_audio(upload: UploadFile, name: str) -> EncodedAudio:
    """The form's spooled file as decoder input, read in place. Each decoding pass rewinds it; one
    upload's passes run one after another on one thread."""
    file = upload.file

    def rewound() -> IO[bytes]:
        file.seek(0)
        return file

    file.seek(0, 2)
    size = file.tell()
    return EncodedAudio(name, rewound, size)
