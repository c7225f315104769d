"""The playground `retouch serve` shows at `/`: plain HTML, CSS and JavaScript, no build step and no
CDN, so it works offline. It talks to the same HTTP API as any client (`retouch.http_api`), reading
progress as Server-Sent Events (`retouch.http_events`).

    index.html      the page
    playground.css  its look
    playground.js   upload or pick a template, paint the mask, submit, watch progress, see the result
"""

from importlib.resources import files

ASSETS = {"index.html": "text/html; charset=utf-8", "playground.css": "text/css; charset=utf-8",
          "playground.js": "text/javascript; charset=utf-8"}


def asset(name: str) -> tuple[bytes, str] | None:
    """(content, media type) of one of the page's files; None for any other name."""
    if name not in ASSETS:
        return None
    return (files(__name__) / name).read_bytes(), ASSETS[name]
