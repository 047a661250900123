"""``qasr serve``: an OpenAI-compatible transcription server on FastAPI (docs/server.md).

One process holds one ``ASR``, shared by every request. The app is ``qasr.server.app.create_app``;
importing this package loads nothing heavy.
"""
