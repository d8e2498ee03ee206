"""Where an updater's data-parallel ranks run (trainer/rank_placement.py): the Ray options and bundles of a
list of GPUs. The placement group on a local Ray: tests/trainer/test_data_parallel.py (its Ray session)."""

from __future__ import annotations

import pytest

from crl_bench.trainer.rank_placement import NOSET_VISIBLE_DEVICES, RankPlacement, rank_placement


def test_listed_gpus_give_one_bundle_per_rank_and_ray_stays_off_the_visible_devices():
    p = rank_placement(3, 2.0, cuda=True, gpus=[5, 6, 7], gpu_fraction=0.5)
    assert p.gpus == [5, 6, 7] and p.bundles == [{"CPU": 2.0, "GPU": 0.5}] * 3
    assert p.options == {"num_cpus": 2.0, "num_gpus": 0.5, "runtime_env": {"env_vars": {NOSET_VISIBLE_DEVICES: "1"}}}
    # without a list, or without CUDA: Ray picks a whole GPU per rank (none on a CPU machine), no group
    assert rank_placement(2, 1.0, cuda=True) == RankPlacement({"num_cpus": 1.0, "num_gpus": 1}, [None, None])
    assert rank_placement(2, 1.0, cuda=False, gpus=[0, 1]) == RankPlacement({"num_cpus": 1.0, "num_gpus": 0},
                                                                            [None, None])
    for bad in ([1], [1, 1], [-1, 0]):
        with pytest.raises(ValueError, match="one distinct GPU per rank"):
            rank_placement(2, 1.0, cuda=True, gpus=bad)
    with pytest.raises(ValueError, match="gpu_fraction"):
        rank_placement(2, 1.0, cuda=True, gpus=[0, 1], gpu_fraction=0)
