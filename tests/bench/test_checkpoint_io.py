"""``crl-bench bench checkpoint-io`` (crl_bench/bench/checkpoint_io.py): the law holds for the way checkpoints are
written (12 bytes per trainable parameter), the disk rates come from a real write, hash and read, and the paper's
checkpoint count follows the lifecycle's rule."""

from __future__ import annotations

import pytest

from crl_bench.bench.checkpoint_io import (
    BYTES_PER_PARAM,
    bench_checkpoint_io,
    checkpoints_per_run,
    format_checkpoint_io,
)


def test_checkpoints_per_run_follows_the_lifecycle():
    assert checkpoints_per_run(512, 100) == 7          # step 0, 100 ... 500, and 512
    assert checkpoints_per_run(512, 10) == 53          # the default every 10
    assert checkpoints_per_run(500, 100, at_start=False) == 5
    assert checkpoints_per_run(512, 0) == 0


def test_the_law_holds_and_the_disk_is_measured(tmp_path):
    res = bench_checkpoint_io(gib=1 / 64, dir=str(tmp_path))
    assert res["law_ok"] and res["bytes_per_param"] == pytest.approx(BYTES_PER_PARAM, rel=0.01)
    assert res["bytes"] >= 2**30 / 64 and min(res["write_gbs"], res["hash_gbs"], res["read_gbs"]) > 0
    assert res["paper_params"] == pytest.approx(11.6e9, rel=0.02)        # Qwen2.5-7B + Qwen3-4B
    assert res["checkpoint_gb"] == pytest.approx(BYTES_PER_PARAM * res["paper_params"] / 1e9)
    assert res["checkpoints"] == 7 and list(tmp_path.iterdir()) == []    # its folder removed
    assert "PASS" in format_checkpoint_io(res)
    with pytest.raises(ValueError, match="gib"):
        bench_checkpoint_io(gib=0)
