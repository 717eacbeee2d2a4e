"""Developer tooling: local test models, the CPU libcuda stand-in, local cluster launch, the demo."""
