"""EAGLE head training on Ray (Ray Train workers, the data stages on Ray actors) equals one process
(the training itself, without Ray: tests/engine/test_eagle.py)."""

from __future__ import annotations

import json

import pytest
import torch

from ray_utils import head_node_args, stop_cluster

from rayspec.eagle.checkpoint import read_state_dict


def test_data_parallel_training_on_ray_equals_one_process(tiny_model_dir, tmp_path, own_cluster):
    """`--num-workers 2` (Ray Train, gloo all-reduce) trains the head one process trains with
    `--grad-accum 2` on the same data: each step takes the same two batches, one per worker. Its
    answers and features (2 Ray actors, chunks of prompts) are the ones one process makes. On a
    multi-node ray.cluster_utils.Cluster (a CPU-less head, two 1-CPU nodes): the target actors and
    the training workers spread over both nodes, the all-reduce crosses nodes."""
    import shutil

    import ray
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from rayspec.eagle.pipeline import prepare_data, run
    from rayspec.eagle.train import TrainConfig, load_target

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Count from {i} to {i + 5}, then {i} words."]}) + "\n"
                               for i in range(8)))
    common = dict(kind="eagle3", target=str(tiny_model_dir), prompts=(str(prompts),), max_new_tokens=12,
                  draft_vocab_size=512, epochs=2, warmup_steps=2, batch_tokens=64, checkpoint_every=100,
                  num_threads=1, answers_only=True)
    one = run(TrainConfig(work_dir=str(tmp_path / "one"), output=str(tmp_path / "head-one"), grad_accum=2, **common))
    (tmp_path / "two").mkdir()  # the same answers and features: only the training differs
    shutil.copy(tmp_path / "one" / "answers.jsonl", tmp_path / "two" / "answers.jsonl")
    shutil.copytree(tmp_path / "one" / "features-eagle3", tmp_path / "two" / "features-eagle3")
    cluster = Cluster(initialize_head=True, head_node_args=head_node_args(**{"num_cpus": 0}))
    nodes = {cluster.add_node(num_cpus=1).node_id for _ in range(2)}
    cluster.wait_for_nodes()
    # RAY_ADDRESS for the job's workers: Ray Train's placement-group cleaner asks Ray's state API whether
    # the training controller lives, at the address it finds on this machine, the newest cluster: on
    # CI's two workers that was once the other worker's, where it found no controller and removed the
    # training workers' placement group mid-run (a WorkerGroupError, "A worker health check failed")
    ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": {"RAY_ADDRESS": cluster.address}})
    try:
        two = run(TrainConfig(work_dir=str(tmp_path / "two"), output=str(tmp_path / "head-two"), num_workers=2,
                              **common))
        # and the data stages on 2 Ray actors: the same answers and features as one process made (the
        # stages alone: `run` chains them to the training as it does for `two`)
        three = TrainConfig(work_dir=str(tmp_path / "three"), output=str(tmp_path / "head-three"), num_workers=2,
                            **common)
        prepare_data(three, *load_target(three))
        placed = {}
        for actor in list_actors(address=cluster.address, limit=1000):
            placed.setdefault(actor.class_name, set()).add(actor.node_id)
        assert placed["_TargetActor"] == nodes and placed["RayTrainWorker"] == nodes, placed
    finally:
        stop_cluster(cluster)
    data = {}
    for d in ("one", "three"):
        rows = [json.loads(line) for line in (tmp_path / d / "answers.jsonl").read_text().splitlines()]
        shards = sorted((tmp_path / d / "features-eagle3").glob("features-*.pt"))
        feats = [f for s in shards for f in torch.load(s, weights_only=True)["aux"]]
        assert len(rows) == len(feats) == 8
        data[d] = {r["prompt"]: (r["output_ids"], f) for r, f in zip(rows, feats)}  # row order may differ
    assert data["one"].keys() == data["three"].keys()
    for prompt, (ids, feat) in data["one"].items():
        assert data["three"][prompt][0] == ids
        torch.testing.assert_close(data["three"][prompt][1], feat, atol=2e-3, rtol=1e-2)
    history = [[json.loads(line) for line in (tmp_path / d / "history-eagle3.jsonl").read_text().splitlines()]
               for d in ("one", "two")]
    assert len(history[0]) == len(history[1]) >= 3  # several steps of 2 batches each
    for a, b in zip(*history):
        assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert history[0][-1]["loss"] < history[0][0]["loss"]
    first, second = read_state_dict(one), read_state_dict(two)
    assert first.keys() == second.keys()
    for k in first:
        torch.testing.assert_close(second[k], first[k], atol=1e-4, rtol=1e-3, msg=k)
