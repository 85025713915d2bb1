"""The replicas that hold models: the verifier (an LLMEngine on its loop thread, its metrics, its
tensor-parallel ranks and paired proposer, the prefix-aware router in front of it) and the proposer pool."""
