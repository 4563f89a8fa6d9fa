"""hookscope benchmarks against plain hooks, nnsight, TransformerLens and torchlens: ``python -m bench``."""
