"""The coordinator: cluster state (directory, loads, replications), the rule-based baseline policy, the ZMQ
control loop and the JSON admin API. Run it with `kvrep coordinator`."""
