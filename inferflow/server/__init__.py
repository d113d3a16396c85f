"""OpenAI-compatible HTTP server: ``inferflow serve [SPEC]`` (FastAPI + uvicorn)."""
