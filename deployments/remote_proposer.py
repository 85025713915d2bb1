"""A rayspec Proposer that drafts in another Serve deployment (the disaggregated topology).

One RPC per engine step carries the whole batch (ProposeRequest list -> Draft list); releases of
finished sequences are queued and ride along on the next call (or on `flush()`, which the engine
loop calls when idle), so there is never an RPC per request per token. It blocks the engine
thread, which is where the engine calls it: `handle.propose.remote(...).result()`.
"""

from __future__ import annotations

import torch

from rayspec.proposers import Draft, Proposer, ProposeRequest


class RemoteProposer(Proposer):
    name = "remote"

    def __init__(self, handle, device: torch.device | str | None = None, timeout_s: float | None = 120.0):
        self.handle = handle
        self.device = torch.device(device) if device is not None else None
        self.timeout_s = timeout_s
        self._released: list[str] = []
        self.num_calls = 0

    def propose(self, requests: list[ProposeRequest]) -> list[Draft]:
        released, self._released = self._released, []
        try:
            drafts = self.handle.propose.remote(requests, released).result(timeout_s=self.timeout_s)
        except BaseException:
            self._released = released + self._released  # try again next time
            raise
        self.num_calls += 1
        if self.device is not None:
            for d in drafts:
                if d.probs is not None and d.probs.device != self.device:
                    d.probs = d.probs.to(self.device)
        return drafts

    def release(self, seq_id: str) -> None:
        self._released.append(seq_id)

    def flush(self) -> None:
        if self._released:
            self.propose([])
