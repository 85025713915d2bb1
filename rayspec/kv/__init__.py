"""The paged KV cache's books, host-only (no tensors): the block manager (a pool of fixed-size blocks,
block tables, reference counts, prefix caching) and the KVSpace over it (slots, each sequence's
cached length, the rows the device has to move). The Scheduler owns the target's, a proposer its
own; rayspec.model's runner holds the pool's tensors and reads them."""
