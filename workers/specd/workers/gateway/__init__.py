"""The gateway tier: the OpenAI-compatible HTTP app (`app`, one `routes_*` module per
surface, `serving`, `sessions`, `errors`, `streams`), its protocol models (`protocol`),
API keys, admin auth, request limits, rate limits, tool calls, reasoning parsers and
metrics."""
