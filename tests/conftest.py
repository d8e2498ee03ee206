"""Shared fixtures: the default model's tokenizer and a tiny randomly initialised Llama built on it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Benchmark data (ALFWorld, WebShop, SWE-bench) comes from ../shared/data beside the project root unless
# CRL_BENCH_DATA already names a data dir (README "Data").
os.environ.setdefault("CRL_BENCH_DATA", str(Path(__file__).resolve().parents[1].parent / "shared" / "data"))


@pytest.fixture(scope="session")
def default_model_dir():
    """Folder of the converted default model (converted once per cache; ~25 s the first time)."""
    from crl_bench.llm.default_model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


@pytest.fixture()
def tiny_model(tokenizer):
    """A 2-layer Llama with the real vocabulary, random weights, fp32, CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
