"""ModelRunner: token lists in, logits out, over a slot KV cache with a fixed memory budget.

Both the verifier (target) and the draft-model proposer use it, each with its own cache.
Slots stay packed (0..n-1): when a sequence leaves, the last slot moves into the hole, so a
forward over every running sequence reads the cache through views, not copies.
"""

from __future__ import annotations

import torch

from rayspec.model import CausalLM, ForwardBatch, KVCache


class CacheFullError(RuntimeError):
    pass


class ModelRunner:
    def __init__(self, model: CausalLM, max_model_len: int, num_slots: int, slack: int):
        """slack: extra positions past max_model_len, written by speculative/padded queries."""
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_model_len = max_model_len
        self.cache = KVCache(model.args, num_slots, max_model_len + slack, self.dtype, self.device)
        self._slot_of: dict[str, int] = {}
        self._seq_in_slot: list[str] = []
        self._cached_len: dict[str, int] = {}  # tokens whose KV is valid, per sequence

    # ---- slots -------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return self.cache.num_slots - len(self._seq_in_slot)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._slot_of

    def allocate(self, seq_id: str) -> None:
        if seq_id in self._slot_of:
            return
        if self.num_free_slots == 0:
            raise CacheFullError("no free KV cache slot")
        self._slot_of[seq_id] = len(self._seq_in_slot)
        self._seq_in_slot.append(seq_id)
        self._cached_len[seq_id] = 0

    def free(self, seq_id: str) -> None:
        slot = self._slot_of.pop(seq_id, None)
        if slot is None:
            return
        self._cached_len.pop(seq_id)
        last_id = self._seq_in_slot.pop()
        if last_id != seq_id:  # move the last sequence into the hole to keep slots packed
            self.cache.copy_slot(self._slot_of[last_id], slot, self._cached_len[last_id])
            self._slot_of[last_id] = slot
            self._seq_in_slot[slot] = last_id

    def cached_len(self, seq_id: str) -> int:
        return self._cached_len[seq_id]

    def set_cached_len(self, seq_id: str, n: int) -> None:
        """Keep the first n cached tokens; later positions are garbage, overwritten next time."""
        self._cached_len[seq_id] = n

    # ---- forward -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seq_ids: list[str], token_lists: list[list[int]], last_only: bool) -> torch.Tensor:
        """Append token_lists[i] to sequence i's cache and return logits.

        Returns [B, vocab] (last real token of each row) if last_only, else [B, Q, vocab]
        with Q = max row length (rows padded at the end; padded logits are meaningless).
        The caller decides afterwards how many of the new tokens stay (`set_cached_len`).
        """
        hidden, lengths = self.forward_hidden(seq_ids, token_lists)
        if last_only:
            idx = torch.tensor([n - 1 for n in lengths], device=self.device)
            hidden = hidden[torch.arange(len(seq_ids), device=self.device), idx]
        return self.model.logits(hidden)

    def forward_hidden(self, seq_ids, token_lists) -> tuple[torch.Tensor, list[int]]:
        B = len(seq_ids)
        lengths = [len(t) for t in token_lists]
        Q = max(lengths)
        starts = [self._cached_len[s] for s in seq_ids]
        for s, start, n in zip(seq_ids, starts, lengths):
            if start + Q > self.cache.capacity:  # padding included: it is written too
                raise CacheFullError(f"sequence {s} exceeds the cache capacity")
        slots_list = [self._slot_of[s] for s in seq_ids]
        padded = [t + [0] * (Q - len(t)) for t in token_lists]
        input_ids = torch.tensor(padded, dtype=torch.long, device=self.device)
        start_t = torch.tensor(starts, dtype=torch.long, device=self.device)
        positions = start_t[:, None] + torch.arange(Q, device=self.device)  # [B, Q]
        kv_len = max(starts) + Q
        if B == 1 and Q == 1:
            mask = None
        else:
            keys = torch.arange(kv_len, device=self.device)
            visible = (keys[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, Q, kv_len]
            # an additive float mask keeps SDPA on its fused CPU kernel (a bool mask falls back to math)
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
        lo = slots_list[0]
        contiguous = slots_list == list(range(lo, lo + B))
        batch = ForwardBatch(
            slots=torch.tensor(slots_list, dtype=torch.long, device=self.device),
            positions=positions,
            kv_len=kv_len,
            mask=mask,
            slot_range=(lo, lo + B) if contiguous else None,
        )
        hidden = self.model(input_ids, self.cache, batch)
        for s, start, n in zip(seq_ids, starts, lengths):
            self._cached_len[s] = start + n
        return hidden, lengths
