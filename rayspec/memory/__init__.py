"""Memory of an engine process from model shapes alone, no weights loaded: the plan (plan: the
engine's KV-cache sizing, a proposer's cache, a process's total for `rayspec plan`), the weights'
bytes (weight_memory) and the activations' (activation_memory); and glibc's allocator kept from
handing freed memory back to the kernel (malloc). Above the model layer and the config, below the
engine (tests/unit/test_imports.py)."""
