"""radix_sync: the torch-free, sglang-free half of sglang-kvrep (wire protocol, page hashing, directory,
coordinator, policies, simulator). Imported by the coordinator, the router, the simulator and the worker agent."""
