"""Serving over HTTP: an OpenAI-compatible server around the engine (`python -m minfer serve`).

    async_engine.py  the engine stepped in the background while requests come and go
    protocol.py      OpenAI's request and response shapes
    metrics.py       /metrics in Prometheus text, with vLLM's metric names
    api_server.py    the FastAPI app, its routes and errors, and the `serve` command
"""
