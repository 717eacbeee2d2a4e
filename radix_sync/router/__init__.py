"""The router (`kvrep router`): the HTTP front door that sends each request to the worker with the lowest expected
TTFT, from the coordinator's exact directory, and falls back to its own approximate view when the coordinator is
away. Modules: `policy` (pure decisions), `tenants`, `tokenize`, `coordinator_link` (the coordinator client),
`metrics`, `server` (the aiohttp app)."""
