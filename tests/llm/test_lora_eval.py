"""A LoRA run's checkpoint (peft adapter + tokenizer) loads merged into its base model, also via the CLI."""

import json

import peft
import pytest
import torch

from crl_bench.llm import default_model
from crl_bench.llm.hf_engine import adapter_base_model, load_model_and_tokenizer


@pytest.fixture()
def base_dir(tmp_path, tiny_model, tokenizer):
    """The tiny random Llama saved as a model folder (so an adapter on it records this path)."""
    path = tmp_path / "base"
    tiny_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _lora(model, seed=1):
    """Wrap ``model`` as the trainer does (Trainer._prepare_model) and give lora_B non-zero weights."""
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                          task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return pm.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def test_adapter_checkpoint_loads_merged(tmp_path, base_dir):
    base, tok = load_model_and_tokenizer(str(base_dir), device="cpu")
    pm = _lora(base)
    ckpt = tmp_path / "checkpoint"
    pm.save_pretrained(ckpt)                   # what Trainer.save_checkpoint writes for a LoRA run
    tok.save_pretrained(ckpt)
    assert json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_dir)
    assert not (ckpt / "config.json").exists()

    merged, tok2 = load_model_and_tokenizer(str(ckpt), device="cpu")
    assert not isinstance(merged, peft.PeftModel)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert tok2.padding_side == "left" and tok2.pad_token_id is not None
    ids = torch.tensor([tok.encode("Hello there, general Kenobi")])
    want = _logits(pm, ids)
    got = _logits(merged, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    plain, _ = load_model_and_tokenizer(str(base_dir), device="cpu")
    assert (got - _logits(plain, ids)).abs().max() > 1e-2     # the adapter changed the model


@pytest.mark.parametrize("recorded", ["cache", "elsewhere", "alias"])
def test_default_model_base_is_resolved_on_this_machine(tmp_path, monkeypatch, base_dir, recorded):
    """An adapter on the default model records the converted checkpoint's path of the machine that
    trained it; it resolves to this machine's converted default model (here: the tiny base)."""
    monkeypatch.setattr(default_model, "prepare_default_model", lambda force=False: base_dir)
    base = {"cache": str(default_model.default_model_dir()),
            "elsewhere": "/home/someone/.cache/crl-bench/models/smollm2-135m-instruct",
            "alias": "smollm2-135m-instruct"}[recorded]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
    assert adapter_base_model(ckpt) == str(base_dir)


def test_other_base_kept_and_empty_base_rejected(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/some-model"}))
    assert adapter_base_model(ckpt) == "org/some-model"
    (ckpt / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": None}))
    with pytest.raises(ValueError, match="base_model_name_or_path"):
        adapter_base_model(ckpt)


def test_cli_eval_of_a_lora_run(tmp_path, monkeypatch, base_dir, tokenizer):
    """``crl-bench eval --run RUN`` of a LoRA run: the adapter is merged, no new adapter is added."""
    import yaml
    from tests_helpers import CoinEnv, coin_config

    from crl_bench.cli import main
    from crl_bench.env_api import register_env
    from crl_bench.trainer.loop import Trainer

    register_env("test-coin", CoinEnv)
    cfg = coin_config("grpo", model={"name": str(base_dir), "lora": True, "lora_r": 4})
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    base, tok = load_model_and_tokenizer(str(base_dir), device="cpu")
    trainer = Trainer(cfg, model=base, tokenizer=tok)
    try:
        assert isinstance(trainer.model, peft.PeftModel)
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.fill_(0.05)
        trainer.save_checkpoint(str(run / "checkpoint"))
    finally:
        trainer.close()

    seen = []
    from crl_bench.trainer.evaluation import Evaluator

    original = Evaluator.evaluate_modes          # crl-bench eval streams its modes through it

    def spy(self, *a, **kw):
        seen.append((type(self.trainer.model), self.cfg.model.lora, self.cfg.model.name))
        return original(self, *a, **kw)

    monkeypatch.setattr(Evaluator, "evaluate_modes", spy)
    assert main(["eval", "--run", str(run), "--episodes", "2", "--quiet"]) == 0
    (model_type, lora, name), = seen
    assert not issubclass(model_type, peft.PeftModel) and lora is False
    assert name == str(run / "checkpoint")
    ev = json.loads((run / "checkpoint-eval-split.json").read_text())
    assert ev["free"]["episodes"] == 2 and ev["model"] == str(run / "checkpoint")


def test_merged_model_is_trainable_like_a_plain_load(tmp_path, base_dir):
    base, tok = load_model_and_tokenizer(str(base_dir), device="cpu")
    _lora(base).save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    merged, _ = load_model_and_tokenizer(str(tmp_path / "ckpt"), device="cpu")
    assert all(p.requires_grad for p in merged.parameters())
