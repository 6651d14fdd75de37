"""The HTTP server: llama-server's and OpenAI's APIs in front of one speculative engine.

app.py      routes, authentication, streaming
limits.py   what a body may hold: size, JSON depth, numbers, text
schemas.py  request bodies -> validated engine requests
responses.py engine results -> llama-server / OpenAI JSON
slots.py    the FIFO queue and the worker thread(s) that own the engines
stops.py    stop strings across token boundaries
metrics.py  Prometheus figures (prometheus_client), also as Python numbers
errors.py   OpenAI-style error bodies
settings.py server-wide defaults
"""

from specwire.server.app import create_app
from specwire.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
