"""The tiny on-disk checkpoint: a model directory any engine can load, built without a download."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from redroll.engine_worker.engines.tiny_checkpoint import (  # noqa: E402
    HIDDEN,
    LAYERS,
    load_tiny_checkpoint,
    save_tiny_checkpoint,
)


def test_the_checkpoint_is_a_model_directory_whose_vocabulary_is_the_tokenizers(tmp_path):
    from transformers import AutoTokenizer

    path = save_tiny_checkpoint(tmp_path / "tiny", seed=3)
    config = json.loads((path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert config["vocab_size"] == len(tokenizer) and config["hidden_size"] == HIDDEN
    assert config["num_hidden_layers"] == LAYERS and config["hidden_size"] // config["num_attention_heads"] == 32
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        config["bos_token_id"], config["eos_token_id"], config["pad_token_id"])
    text = "Grüße, 東京 😀 and a queue"
    assert tokenizer.decode(tokenizer.encode(text)) == text  # byte-level: any text round-trips


def test_one_seed_gives_the_same_weights_and_another_seed_other_ones(tmp_path):
    import torch

    a = load_tiny_checkpoint(save_tiny_checkpoint(tmp_path / "a", seed=1))
    b = load_tiny_checkpoint(save_tiny_checkpoint(tmp_path / "b", seed=1))
    c = load_tiny_checkpoint(save_tiny_checkpoint(tmp_path / "c", seed=2))
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not torch.equal(pa["lm_head.weight"], pc["lm_head.weight"])
    assert all(p.dtype == torch.float32 for p in pa.values())
