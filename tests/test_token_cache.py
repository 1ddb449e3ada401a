"""labkit.data.token_cache_path: the pre-tokenised shard that load_tokens writes and reads (notebook 04)."""
import numpy as np
import pytest
import torch

from labkit.data import corpus as data


def test_load_tokens_writes_the_shard_at_token_cache_path(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(data, "_TOKENS", {})
    path = data.token_cache_path("shakespeare")
    assert path.parent == tmp_path and not path.exists()
    tokens = data.load_tokens("shakespeare")
    assert path.exists()
    assert torch.equal(torch.from_numpy(np.load(path).astype(np.int64)), tokens)


def test_token_cache_path_depends_on_the_corpus():
    assert data.token_cache_path("shakespeare") != data.token_cache_path("tinystories")
    with pytest.raises(ValueError, match="unknown corpus"):
        data.token_cache_path("nope")
