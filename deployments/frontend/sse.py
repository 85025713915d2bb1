"""Headers of every server-sent-events response (streamed completions and chat completions).

A reverse proxy in front of the server (nginx, a cloud load balancer) may buffer a response before
passing it on: a stream would then reach its client in lumps, or only at its end. These headers ask
it not to: `X-Accel-Buffering: no` (nginx, and proxies that copy its convention), `Cache-Control:
no-cache` (no cache may hold or replay an event stream; also what the SSE spec's clients send).
`Content-Type: text/event-stream` comes from the response's media type.
"""

from __future__ import annotations

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
