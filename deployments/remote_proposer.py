"""A rayspec Proposer that drafts in another Serve deployment (the disaggregated topology).

One RPC per engine step carries the whole batch (ProposeRequest list -> Draft list); releases of
finished sequences are queued and ride along on the next call (or on `flush()`, which the engine
loop calls when idle), so there is never an RPC per request per token. It blocks the engine
thread, which is where the engine calls it: `handle.propose.remote(...).result()`.

EAGLE: `feature_layers` is asked of the proposer deployment once, at construction; the engine
reads it and then puts the target features of every newly committed token into the requests,
which are sent as CPU tensors. Drafts come back whole: token trees keep their `parents`.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from rayspec.proposers import Draft, Proposer, ProposeRequest


class RemoteProposer(Proposer):
    name = "remote"

    def __init__(self, handle, device: torch.device | str | None = None, timeout_s: float | None = 120.0,
                 startup_timeout_s: float | None = 1800.0):
        self.handle = handle
        self.device = torch.device(device) if device is not None else None
        self.timeout_s = timeout_s
        self._released: list[str] = []
        self.num_calls = 0
        self.call_seconds = 0.0  # wall time of propose calls seen from here (transport + drafting)
        # waits for the proposer replica to be up (it may be loading a large target's embedding)
        layers = handle.feature_layers.remote().result(timeout_s=startup_timeout_s)
        self.feature_layers: tuple[int, ...] | None = None if layers is None else tuple(layers)

    @staticmethod
    def _portable(req: ProposeRequest) -> ProposeRequest:
        if req.features is None or req.features.device.type == "cpu":
            return req
        return dataclasses.replace(req, features=req.features.cpu())

    def propose(self, requests: list[ProposeRequest]) -> list[Draft]:
        requests = [self._portable(r) for r in requests]
        released, self._released = self._released, []
        started = time.perf_counter()
        try:
            drafts = self.handle.propose.remote(requests, released).result(timeout_s=self.timeout_s)
        except BaseException:
            self._released = released + self._released  # try again next time
            raise
        self.num_calls += 1
        self.call_seconds += time.perf_counter() - started
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
