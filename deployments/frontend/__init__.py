"""The OpenAI front end: the HTTP ingress deployment and what it needs per request (request and
response models, limits and errors, admission, API key, SSE headers, `n` choices, failover)."""
