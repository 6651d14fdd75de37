"""The live page served at GET / by `specwire serve` (off with --no-webui).

index.html      the page: plain HTML, CSS and JS, charts drawn as inline SVG, no build step
routes.py       GET / and GET /stats.json
figures.py      /stats.json's content
exposition.py   the /metrics text read back, so the page shows what a scrape sees
recent.py       the last requests and acceptance by draft position
"""

from specwire.server.webui.recent import RecentRequests
from specwire.server.webui.routes import install

__all__ = ["RecentRequests", "install"]
