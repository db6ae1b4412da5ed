"""The node's HTTP side on aiohttp: the probes and metrics (``metrics_address``) and the
HTTP/JSON API (``http_socket``, ``http_address``): every wire method as ``POST /v1/<method>``,
subscriptions as Server-Sent Events, the OpenAPI document (docs/http.md)."""
