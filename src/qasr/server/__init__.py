"""``qasr serve``: an OpenAI-compatible transcription server on FastAPI (docs/server.md).

One process holds one ``ASR`` (one engine) shared by every request; requests are batched by the engine,
never serialised by a lock. Import ``create_app`` from ``qasr.server.app`` (this package loads nothing
heavy on import).
"""
