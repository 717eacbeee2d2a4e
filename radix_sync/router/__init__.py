"""The router (`kvrep router`): the HTTP front door that sends each request to the worker with the lowest expected
TTFT, from the coordinator's exact directory, and falls back to its own approximate view when the coordinator is
away. Modules: `app` (the aiohttp app: routes, handlers, `build_app`, `serve`), `service` (`Router`: decide,
forward, report), `proxy` (forwarding, streaming relay, failover), `pool` (the workers, by URL, and the router's
own queued-work accounting), `policy` (pure ranking), `tenants`, `tokenize`, `coordinator_link` (the coordinator
client), `directory_replica` (the local mirror of the directory), `metrics`, `config`."""
