"""The OpenAI-compatible HTTP front end: `gouache.api.server.create_app(engine, config)`.

Kept import-light (FastAPI and pydantic only, never torch); this package file imports nothing
so that `gouache.api.protocol` can be used by clients without pulling in the server.
"""
