"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over the async engine: `moe-infer serve`.

Needs the `server` extra (`pip install "moe_infer[server]"`); `import moe_infer` never imports it.
Layout: protocol.py (the API's pydantic models), one module per endpoint family (completions.py,
chat.py, info.py, metrics.py), serving.py (what they share), middleware.py (API key, body size),
app.py (builds the FastAPI app), launch.py (the `serve` entry, the torchrun ranks).
"""
