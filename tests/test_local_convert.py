"""A local-tier checkpoint (two-tier mode) converted into a normal one: offline
(``convert_local_checkpoint``, ``dist-ckpt convert-local``) and on restore
(``CheckpointManager.load(..., persist_local=True)``); saved by real gloo ranks (nodes
simulated by an explicit rank -> node mapping and one directory per node), loaded back
under another layout and world size, bit-exact."""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, CheckpointManager, ShardedObject, ShardedTensor
from dist_checkpointing.cli import main as cli
from dist_checkpointing.integrity.checksums import checksum
from dist_checkpointing.manager import convert_local_checkpoint

from .conftest import get_pool
from .helpers import assert_all_raise, flip_byte


def _global(name: str, shape: tuple, step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    seed = 1000 * step + sum(map(ord, name))
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _w(step: int) -> torch.Tensor:
    return _global("w", (8, 12), step)


def _emb(step: int) -> torch.Tensor:
    return _global("emb", (10, 6), step, torch.bfloat16)


def _adam(step: int) -> torch.Tensor:
    return _global("adam", (6, 4), step)


def _state(rank: int, world: int, step: int) -> dict:
    """A training layout: ``w`` split by columns over every rank, ``emb`` (bf16) split by
    rows over two tensor-parallel ranks and replicated over the data-parallel ones, ``adam``
    flattened over every rank (distributed-optimizer style), an object per rank, common
    values (a plain tensor among them)."""
    tp, dp = rank % 2, rank // 2
    cols, numel = 12 // world, 24 // world
    piece = slice(rank * numel, (rank + 1) * numel)
    return {"model": {"w": ShardedTensor.from_rank_offsets("w", _w(step)[:, rank * cols:(rank + 1) * cols].clone(),
                                                           (1, rank, world)),
                      "emb": ShardedTensor.from_rank_offsets("emb", _emb(step)[tp * 5:(tp + 1) * 5].clone(), (0, tp, 2),
                                                             replica_id=dp)},
            "optim": [ShardedTensor.from_rank_offsets_flat("adam", _adam(step).flatten()[piece].clone(), (6, 4),
                                                           flattened_range=piece)],
            "rng": ShardedObject("rng", {"rank": rank, "step": step}, (world,), (rank,)),
            "step": step, "scale": torch.tensor([0.5, step]), "args": {"lr": 0.1, "layers": [1, 2]}}


def _train(rank: int, world: int, root: str, local: str, nodes: list, steps: list) -> list:
    with CheckpointManager(root, save_interval_steps=100, local_dir=local, local_interval=1, replication_factor=2,
                           node_of_rank=nodes) as m:
        for step in steps:
            m.save(step, _state(rank, world, step))
        m.wait_until_finished()
        return list(m.local.complete)


def _load_other_layout(rank: int, world: int, ckpt: str, step: int, saved_world: int) -> None:
    """Load under another layout: ``w`` by rows, ``emb`` and ``adam`` whole on every rank."""
    rows = 8 // world
    request = {"model": {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(rows, 12), (0, rank, world)),
                         "emb": ShardedTensor.from_rank_offsets("emb", torch.zeros(10, 6, dtype=torch.bfloat16),
                                                                replica_id=rank)},
               "optim": [ShardedTensor.from_rank_offsets("adam", torch.zeros(6, 4), replica_id=rank)],
               "rng": ShardedObject("rng", None, (saved_world,), (saved_world - 1,), replica_id=rank)}
    loaded = dc.load(request, ckpt)
    assert torch.equal(loaded["model"]["w"], _w(step)[rank * rows:(rank + 1) * rows])
    assert torch.equal(loaded["model"]["emb"], _emb(step))
    assert torch.equal(loaded["optim"][0], _adam(step))
    assert loaded["rng"] == {"rank": saved_world - 1, "step": step}
    assert loaded["step"] == step and loaded["args"] == {"lr": 0.1, "layers": [1, 2]}
    assert torch.equal(loaded["scale"], torch.tensor([0.5, step]))
    assert "__local_tier_other_ranks__" not in loaded


NODES = {2: [0, 1], 4: [0, 0, 1, 1]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """Local-tier steps 1..3 saved at world 4 (2 nodes of 2 ranks) and at world 2 (2 nodes of 1)."""
    runs = {}
    for world in (4, 2):
        base = tmp_path_factory.mktemp(f"world{world}")
        assert get_pool(world).run(_train, str(base / "root"), str(base / "node{node}"), NODES[world],
                                   [1, 2, 3]) == [[1, 2, 3]] * world
        runs[world] = base
    return runs


def _nodes(tmp_path: Path, trained: dict, world: int = 4) -> list:
    """A copy of the node directories of the ``world`` run, to damage."""
    dirs = []
    for node in (0, 1):
        shutil.copytree(trained[world] / f"node{node}", tmp_path / f"node{node}")
        dirs.append(str(tmp_path / f"node{node}"))
    return dirs


@pytest.mark.parametrize("saved_world,load_world", [(4, 2), (2, 4)])
def test_converted_checkpoint_loads_under_another_layout_and_world(trained, tmp_path, saved_world, load_world):
    nodes = [str(trained[saved_world] / f"node{n}") for n in (0, 1)]
    out = tmp_path / "converted"
    done = convert_local_checkpoint(nodes, out)
    assert (done.step, done.world) == (3, saved_world)
    # main replicas only: w and adam from every rank, emb from the 2 tensor-parallel ranks of dp 0
    assert (done.tensors, done.objects) == (2 * saved_world + 2, saved_world)
    # the first node directory holds every rank's copy (its own ranks' and their partners' replicas)
    assert done.sources == {r: os.path.join(nodes[0], "local_0000003", f"rank_{r:05d}.pt") for r in range(saved_world)}
    get_pool(load_world).run(_load_other_layout, str(out), 3, saved_world)
    assert cli(["validate", str(out)]) == 0


def test_converts_into_a_url(trained, ckpt_location):
    nodes = [str(trained[4] / f"node{n}") for n in (0, 1)]
    out = ckpt_location("converted")
    assert convert_local_checkpoint(nodes, out).step == 3
    get_pool(2).run(_load_other_layout, out, 3, 4)
    with pytest.raises(CheckpointingException, match="converted.* is not empty"):
        convert_local_checkpoint(nodes, out)


def test_converts_from_replicas_when_a_node_is_lost(trained, tmp_path):
    nodes = _nodes(tmp_path, trained)
    shutil.rmtree(nodes[0])
    os.mkdir(nodes[0])  # node 0 replaced: ranks 0 and 1 only have their replicas on node 1
    done = convert_local_checkpoint(nodes, tmp_path / "out", step=3)
    assert done.sources == {r: os.path.join(nodes[1], "local_0000003", f"rank_{r:05d}.pt") for r in range(4)}
    get_pool(2).run(_load_other_layout, str(tmp_path / "out"), 3, 4)


def test_a_damaged_copy_uses_the_replica_and_all_damaged_is_an_error(trained, tmp_path):
    nodes = _nodes(tmp_path, trained)
    own = Path(nodes[0]) / "local_0000003" / "rank_00001.pt"
    flip_byte(own, 10)
    done = convert_local_checkpoint(nodes, tmp_path / "out")
    assert done.sources[1] == os.path.join(nodes[1], "local_0000003", "rank_00001.pt")
    get_pool(2).run(_load_other_layout, str(tmp_path / "out"), 3, 4)
    replica = Path(nodes[1]) / "local_0000003" / "rank_00001.pt"
    flip_byte(replica, 10)
    with pytest.raises(CheckpointingException, match="every copy of rank 1's shards of step 3 is damaged") as e:
        convert_local_checkpoint(nodes, tmp_path / "out2")
    assert str(own) in str(e.value) and str(replica) in str(e.value)
    assert not (tmp_path / "out2").exists()


def test_a_missing_rank_is_named(trained, tmp_path):
    nodes = _nodes(tmp_path, trained)
    for node in nodes:
        for ext in ("done", "pt"):
            os.remove(Path(node) / "local_0000003" / f"rank_00002.{ext}")
    with pytest.raises(CheckpointingException, match=r"no copy of rank 2's shards of step 3 \(ranks missing: \[2\]\)"):
        convert_local_checkpoint(nodes, tmp_path / "out", step=3)
    with pytest.raises(CheckpointingException, match=r"no step is complete in .*node0.*steps found: \[3\]"):
        convert_local_checkpoint(nodes, tmp_path / "out")


def _set_job(node_dir: Path, job: dict) -> None:
    """Make every marker in ``node_dir`` claim ``job``."""
    for marker in node_dir.glob("local_*/rank_*.done"):
        marker.write_text(json.dumps(json.loads(marker.read_text()) | {"job": job}))


def _job(node_dir: Path) -> dict:
    return json.loads(next(node_dir.glob("local_*/rank_*.done")).read_text())["job"]


def test_copies_of_two_jobs_are_never_mixed(trained, tmp_path):
    nodes = [str(trained[4] / "node0"), str(trained[2] / "node1")]  # step 3 of two jobs
    for kwargs in ({"step": 3}, {}):
        with pytest.raises(CheckpointingException, match=r"copies of step 3 belong to 2 jobs \(root .*world2.*root "
                                                         r"\(run .*\) in .*node1; root .*world4.*root .*node0\).*--root"):
            convert_local_checkpoint(nodes, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()
    # naming the job: its copies only (node 0 of the world-4 run holds every rank's copy)
    done = convert_local_checkpoint(nodes, tmp_path / "out", root=str(trained[4] / "root"))
    assert (done.step, done.world, done.job) == (3, 4, _job(trained[4] / "node0"))
    assert set(done.sources.values()) <= {os.path.join(nodes[0], "local_0000003", f"rank_{r:05d}.pt") for r in range(4)}
    get_pool(2).run(_load_other_layout, str(tmp_path / "out"), 3, 4)
    done = convert_local_checkpoint(nodes, tmp_path / "out2", root=str(trained[2] / "root"))
    assert (done.step, done.world, done.job) == (3, 2, _job(trained[2] / "node1"))  # node 1 holds both its ranks
    assert cli(["convert-local", *nodes, str(tmp_path / "out3"), "--root", str(trained[4] / "root") + "/"]) == 0


def test_copies_of_different_world_sizes_are_refused(trained, tmp_path):
    shutil.copytree(trained[2] / "node1", tmp_path / "node1")
    _set_job(tmp_path / "node1", _job(trained[4] / "node0"))  # one job, restarted with another world size
    nodes = [str(trained[4] / "node0"), str(tmp_path / "node1")]
    with pytest.raises(CheckpointingException, match=r"saved by different world sizes \(by 2 ranks in .*node1; "
                                                     r"by 4 ranks in .*world4.*node0\)"):
        convert_local_checkpoint(nodes, tmp_path / "out", step=3)
    with pytest.raises(CheckpointingException, match=r"copies of step 3 were saved by different world sizes"):
        convert_local_checkpoint(nodes, tmp_path / "out")
    assert not (tmp_path / "out").exists()


_HOSTILE = {"empty": lambda doc: {}, "string step": lambda doc: doc | {"step": "3"},
            "step 2**70": lambda doc: doc | {"step": 2**70}, "world 2**70": lambda doc: doc | {"world": 2**70},
            "negative length": lambda doc: doc | {"length": -1}, "list owner": lambda doc: doc | {"owner": [1]}}


@pytest.mark.parametrize("how", sorted(_HOSTILE))
def test_hostile_markers_are_damaged_copies_in_conversion(trained, tmp_path, how):
    nodes = _nodes(tmp_path, trained)
    own = Path(nodes[0]) / "local_0000003" / "rank_00001.done"
    own.write_text(json.dumps(_HOSTILE[how](json.loads(own.read_text()))))
    done = convert_local_checkpoint(nodes, tmp_path / "out")  # rank 1's replica on node 1 is used
    assert done.sources[1] == os.path.join(nodes[1], "local_0000003", "rank_00001.pt")
    replica = Path(nodes[1]) / "local_0000003" / "rank_00001.done"
    replica.write_text(json.dumps(_HOSTILE[how](json.loads(replica.read_text()))))
    with pytest.raises(CheckpointingException, match=r"no copy of rank 1's shards of step 3|no step is complete"):
        convert_local_checkpoint(nodes, tmp_path / "out2", step=3)


def test_a_valid_marker_claiming_a_huge_world_allocates_nothing(trained, tmp_path):
    nodes = _nodes(tmp_path, trained)
    for node in nodes:  # every copy of step 3 claims 2**24 ranks: valid markers, an incomplete step
        for marker in Path(node).glob("local_0000003/*.done"):
            marker.write_text(json.dumps(json.loads(marker.read_text()) | {"world": 2**24}))
    with pytest.raises(CheckpointingException, match=r"ranks missing: \[4, 5, 6, 7, 8\] \.\.\. 16777212 in all"):
        convert_local_checkpoint(nodes, tmp_path / "out", step=3)
    with pytest.raises(CheckpointingException, match="no step is complete"):
        convert_local_checkpoint(nodes, tmp_path / "out")


def test_a_step_not_present_and_bad_outputs_or_dirs_are_refused(trained, tmp_path):
    nodes = [str(trained[4] / f"node{n}") for n in (0, 1)]
    with pytest.raises(CheckpointingException, match=r"step 7 is not in .*node0.*node1 \(steps found: \[3\]\)"):
        convert_local_checkpoint(nodes, tmp_path / "out", step=7)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointingException, match=r"full.* is not empty"):
        convert_local_checkpoint(nodes, tmp_path / "full")
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
    with pytest.raises(CheckpointingException, match=r"nowhere is not a local directory"):
        convert_local_checkpoint([*nodes, str(tmp_path / "nowhere")], tmp_path / "out")
    with pytest.raises(CheckpointingException, match="at least one node directory"):
        convert_local_checkpoint([], tmp_path / "out")


def _convert_in_a_rank(rank: int, world: int, nodes: list, out: str) -> None:
    convert_local_checkpoint(nodes, out)


def test_conversion_refuses_to_run_collectively(trained, tmp_path):
    nodes = [str(trained[4] / f"node{n}") for n in (0, 1)]
    errors = get_pool(2).run_expect_error(_convert_in_a_rank, nodes, str(tmp_path / "out"))
    assert_all_raise(errors, 2, "runs in one process, not collectively")
    assert not (tmp_path / "out").exists()


class _CreatesAFile:
    """Unpickling it would create ``path`` (code a header must never run)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _as_plain_pickle_markers(node_dir: Path, flag: Path) -> None:
    """Rewrite every marker's header as a plain pickle (an earlier version's encoding) that
    would create ``flag`` when unpickled; checksums kept valid."""
    for marker_path in node_dir.glob("local_*/rank_*.done"):
        marker = json.loads(marker_path.read_text())
        old = pickle.dumps({"layout": [], "values": {"c:/step": _CreatesAFile(str(flag))}})
        marker["header"], marker["header_checksum"] = base64.b64encode(old).decode(), f"{checksum(old):016x}"
        marker_path.write_text(json.dumps(marker))


def _restore(rank: int, world: int, root: str, local: str, persist: bool) -> tuple:
    with CheckpointManager(root, save_interval_steps=100, local_dir=local, local_interval=1, replication_factor=2,
                           node_of_rank=NODES[world]) as m:
        loaded = m.load(_state(rank, world, 0), persist_local=persist)
        kind, step = m.restored_from
        expected = _state(rank, world, step)
        assert torch.equal(loaded["model"]["w"], expected["model"]["w"].data)
        assert torch.equal(loaded["optim"][0], expected["optim"][0].data)
        assert loaded["rng"] == {"rank": rank, "step": step} and loaded["step"] == step
        m.save(step + 1, _state(rank, world, step + 1))  # training goes on (the restored step is not saved again)
        m.wait_until_finished()
        return kind, step, m.all_steps(), list(m.local.complete)


def _restore_expecting_error(rank: int, world: int, root: str, local: str) -> None:
    with CheckpointManager(root, save_interval_steps=100, local_dir=local, local_interval=1, replication_factor=2,
                           node_of_rank=NODES[world]) as m:
        m.load(_state(rank, world, 0))


def test_plain_pickle_headers_are_refused_unread(trained, tmp_path):
    nodes = _nodes(tmp_path, trained)
    flag = tmp_path / "code_ran"
    for node in nodes:
        _as_plain_pickle_markers(Path(node), flag)
    with pytest.raises(CheckpointingException, match=r"every copy of rank 0's shards of step 3 is damaged.*"
                                                     r"not one this version writes"):
        convert_local_checkpoint(nodes, tmp_path / "out")
    # restore: every copy refused as a damaged one would be; no persistent step to fall back to
    errors = get_pool(4).run_expect_error(_restore_expecting_error, str(trained[4] / "root"),  # (its job's root)
                                          str(tmp_path / "node{node}"))
    assert_all_raise(errors, 4, "no complete checkpoint")
    assert not flag.exists()


def test_persist_local_saves_the_restored_step_persistently(tmp_path):
    root = tmp_path / "root"
    get_pool(4).run(_train, str(root), str(tmp_path / "node{node}"), NODES[4], [1, 2, 3])
    shutil.rmtree(tmp_path / "node1")  # ranks 2 and 3 restore from node 0's replicas
    assert get_pool(4).run(_restore, str(root), str(tmp_path / "node{node}"), True) == [("local", 3, [3], [3, 4])] * 4
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    get_pool(2).run(_load_other_layout, str(root / "iter_0000003"), 3, 4)


def test_cli_convert_local(trained, tmp_path, capsys):
    nodes = [str(trained[2] / f"node{n}") for n in (0, 1)]
    out = tmp_path / "root" / "iter_0000003"
    assert cli(["convert-local", "--step", "3", *nodes, str(out)]) == 0
    assert f"{out}: step 3 of 2 ranks: 6 tensor chunks" in capsys.readouterr().out
    with CheckpointManager(tmp_path / "root") as m:  # the manager takes it as a step of its root
        assert m.all_steps() == [3]
    get_pool(4).run(_load_other_layout, str(out), 3, 2)
    assert cli(["convert-local", *nodes, str(out)]) == 1
    assert "is not empty" in capsys.readouterr().err
    assert cli(["convert-local", *nodes, str(tmp_path / "other"), "--step", "9"]) == 1
    assert "step 9 is not in" in capsys.readouterr().err
