"""The ``devices`` section (crl_bench/config_devices.py): where each role lives on a CUDA machine, its rules
checked when the configuration is built, and its indices ignored by a run without CUDA."""

from __future__ import annotations

import pytest

from crl_bench.config import ConfigError, DevicesConfig, build_config, preset_data
from crl_bench.config_devices import driver_device, placed


def test_the_default_places_nothing_and_a_cpu_run_ignores_a_layout(monkeypatch):
    import torch

    cfg = build_config([])
    assert cfg.devices == DevicesConfig() and driver_device(cfg) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert placed([2, 3]) is None and placed([]) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert placed([2, 3]) == [2, 3] and placed([]) is None


def test_gpu_lists_from_the_command_line_and_the_shipped_paper_layout():
    # --set devices.actor_train=2,3
    cfg = build_config([{"train": {"workers": 2}, "devices": {"actor_train": "2,3"}}])
    assert cfg.devices.actor_train == [2, 3] and cfg.devices != DevicesConfig()
    paper = build_config([preset_data("paper"), {"method": "complementary"}])
    d = paper.devices
    assert d.driver == "cpu" and driver_device(paper) == "cpu"
    assert d.actor_engine == [0] and d.extractor_engine == [1]
    assert d.actor_train == d.extractor_train == [2, 3, 4, 5, 6, 7] == list(range(2, 2 + paper.train.workers))
    assert d.weight_sync == "direct"
    direct = build_config([{**VLLM_DP, "method": "complementary", "extractor": {"engine": "vllm"},
                            "devices": {"weight_sync": "direct"}}])
    assert direct.devices.weight_sync == "direct"


#: data-parallel updates into a vLLM engine: what devices.weight_sync=direct needs at least
VLLM_DP = {"generation": {"engine": "vllm"}, "train": {"workers": 2}}


@pytest.mark.parametrize("layer, message", [
    ({"devices": {"actor_train": [2, 2]}, "train": {"workers": 2}}, r"devices.actor_train: \[2, 2\]"),
    ({"devices": {"extractor_engine": [-1]}, "extractor": {"engine": "vllm"}}, r"devices.extractor_engine: \[-1\]"),
    ({"devices": {"actor_train": [2]}, "train": {"workers": 2}}, "names 1 GPU.*train.workers is 2"),
    ({"devices": {"extractor_train": [0, 1]}}, "names 2 GPU.*train.workers is 1"),
    ({"devices": {"actor_engine": [1]}}, "needs generation.engine=vllm"),
    ({"devices": {"extractor_engine": [1]}}, "needs extractor.engine=vllm"),
    ({"devices": {"driver": "cpu"}}, r"train.workers > 1"),
    ({"devices": {"driver": "cpu"}, "train": {"workers": 2}}, "devices.actor_engine"),
    ({"method": "complementary", "devices": {"driver": "cpu", "actor_engine": [0]}, "train": {"workers": 2},
      "generation": {"engine": "vllm"}}, "set extractor.engine=vllm"),
    ({"devices": {"driver": "gpu"}}, "devices.driver"),
    ({"devices": {"weight_sync": "direct"}}, "weight_sync=direct: .*train.workers > 1"),
    ({"devices": {"weight_sync": "direct"}, "train": {"workers": 2}}, "weight_sync=direct: .*generation.engine=vllm"),
    ({**VLLM_DP, "devices": {"weight_sync": "direct"}, "model": {"lora": True}}, "weight_sync=direct: .*model.lora"),
    ({**VLLM_DP, "devices": {"weight_sync": "direct"}, "method": "internalise"}, "weight_sync=direct: .*'internalise'"),
    ({**VLLM_DP, "devices": {"weight_sync": "direct"}, "method": "complementary"},
     "weight_sync=direct: .*extractor.engine=vllm"),
    ({**VLLM_DP, "devices": {"weight_sync": "direct", "actor_engine": [0, 1], "actor_train": [1, 2]}},
     "weight_sync=direct: rank 0 of devices.actor_train .* GPU 1 is also in devices.actor_engine"),
    ({"devices": {"weight_sync": "nccl"}}, "devices.weight_sync"),
])
def test_a_layout_that_cannot_run_is_refused_naming_its_keys(layer, message):
    with pytest.raises(ConfigError, match=message):
        build_config([layer])


def test_a_case_bank_keeps_no_extractor_in_the_driver_so_it_needs_no_extractor_engine():
    cfg = build_config([{"method": "casebank", "devices": {"driver": "cpu", "actor_engine": [0]},
                         "train": {"workers": 2}, "generation": {"engine": "vllm"}}])
    assert cfg.devices.driver == "cpu"
