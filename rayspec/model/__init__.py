"""The model layer: one forward of a model over the paged KV cache, and what it is built from. The
native Llama-family decoder (native) and transformers' modeling code over the same cache (generic),
the shapes read per family (families), the layers (linear, parallel, quantize), the KV cache, its
books and its paged attention (kv_cache, kv_space, block_manager, paged_attention), checkpoints read and
models built (weights/, formats/, loader), the ranks of a tensor-parallel model (tp_ranks), and
ModelRunner (runner, with batch_layout and compiled): token lists in, logits out, the one surface the
verifier and the proposers drive. It imports nothing of sampling, proposers, config, memory or the
engine (tests/unit/test_imports.py)."""
