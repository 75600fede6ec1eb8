"""The OpenAI-compatible HTTP server (`krait serve`): api_server (FastAPI app, uvicorn entry),
protocol (pydantic request/response shapes), metrics (Prometheus)."""
