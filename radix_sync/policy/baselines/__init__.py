"""The baseline routers, one module per published system, each a model of that system's rule with its source
cited on the class. Importing this package registers them in `radix_sync.policy.routers.ROUTERS` (the simulator's
`radix_sync.sim.policies` does; so must any other caller of `make_router` that wants a baseline by name).

- `dynamo`: `cost` (NVIDIA Dynamo's KV router);
- `smg`: `cache_aware` (smg 1.13), `cache_aware_v03` (sglang-router 0.3.2), `sticky` (smg `prefix_hash`);
- `mooncake`: `pull` (Mooncake's Algorithm 1, copy on the critical path);
- `llmd`: `precise` (llm-d's precise prefix-cache scorer with its load scorers);
- `preble`: `e2` (E2-like).
"""

from radix_sync.policy.baselines import dynamo, llmd, mooncake, preble, smg  # noqa: F401 (registration)
