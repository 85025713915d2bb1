"""What rayspec does for CPUs alone: which matmul kernel a model's projections use on the CPU at
hand, measured once per machine (kernels). It imports nothing else of rayspec, so every layer may use
it (tests/unit/test_imports.py)."""
