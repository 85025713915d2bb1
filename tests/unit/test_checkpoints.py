"""Training checkpoints (rayspec.eagle): written atomically (a crash mid-write leaves the previous
one whole) and read back with torch.load(weights_only=True), so a tampered resume file runs no code."""

from __future__ import annotations

import pickle

import pytest
import torch

from rayspec.eagle.checkpoint import save_atomic
from rayspec.eagle.train import load_checkpoint


def _state(step: int) -> dict:
    layer = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    layer(torch.ones(2, 4)).sum().backward()
    opt.step()
    sched.step()
    return {"head": layer.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step,
            "batches_per_step": 2, "draft_vocab_size": None}


def test_a_checkpoint_round_trips_through_weights_only_loading(tmp_path):
    path = tmp_path / "checkpoint-eagle3.pt"
    save_atomic(_state(7), path)
    ckpt = load_checkpoint(path, "cpu")
    assert ckpt["step"] == 7 and ckpt["opt"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left


def test_a_crash_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint-eagle3.pt"
    save_atomic(_state(1), path)

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_atomic(_state(2), path)
    monkeypatch.undo()
    assert load_checkpoint(path, "cpu")["step"] == 1
    assert list(tmp_path.iterdir()) == [path]


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_tampered_checkpoint_runs_no_code(tmp_path):
    marker, path = tmp_path / "pwned", tmp_path / "checkpoint-eagle3.pt"
    torch.save({"step": 3, "opt": _Evil(marker)}, path, pickle_module=pickle)
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(path, "cpu")
    assert not marker.exists()
