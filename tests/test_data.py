"""labkit.data and labkit.data.train_tokenizer: corpora, tokenizers, token cache, batches and the sharding rule.

The `datasets` test takes a few seconds (importing `datasets` is slow); the rest is fast.
"""
import math

import pytest
import torch

import labkit.data.corpus as data
from labkit.data import (check_seq_len, check_vocab, get_batch, get_tokenizer, load_stories, load_text,
                         load_tokens, split_tokens)
from labkit.model import get_config


@pytest.fixture(scope="module")
def tokens():
    return load_tokens("tinystories")


def test_tokenizer_has_4096_pieces_and_round_trips_unicode_and_newlines():
    tok = get_tokenizer()
    assert tok.vocab_size == 4096 and tok.bos_id == 1
    text = "Once upon a time, Lily saw a “big” dog.\nIt was 123 years old – café!"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(text, bos=True)[0] == 1


def test_shipped_tokenizer_is_reproduced_byte_identical_by_training_twice():
    from labkit.data.train_tokenizer import TOKENIZER_PATH, train

    first, second = train(), train()
    assert first == second
    assert first == TOKENIZER_PATH.read_bytes()


def test_local_sample_has_all_2316_stories():
    stories = load_stories()
    assert len(stories) == 2316
    assert stories[0].startswith("One day, a little girl named Lily found a needle")
    assert all("<|endoftext|>" not in s for s in stories)


def test_datasets_code_path_offline_reads_the_same_stories(tmp_path, monkeypatch):
    pytest.importorskip("datasets", reason="the Hugging Face path needs `datasets` (pinned in pyproject; a GPU node may lack it)")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    stories = load_stories("datasets-local", cache_dir=tmp_path / "hf")
    assert stories == load_stories("local")
    assert any((tmp_path / "hf").iterdir())  # the arrow cache went where we asked


def test_hub_source_asks_datasets_for_roneneldan_tinystories_streams_max_stories_and_normalises(monkeypatch):
    datasets = pytest.importorskip("datasets", reason="the Hugging Face path needs `datasets` (pinned in pyproject)")

    calls, rows = [], ["Tom had a ball.\n\nHe played.  ", "Sue ran.", "Not asked for."]

    class FakeStream:
        def take(self, n):
            return [{"text": t} for t in rows[:n]]

    def fake_load_dataset(path, split=None, cache_dir=None, streaming=False):
        calls.append((path, split, streaming))
        return FakeStream() if streaming else {"text": rows}

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_stories("hub", split="validation", max_stories=2) == ["Tom had a ball.\nHe played.", "Sue ran."]
    assert len(load_stories("hub")) == 3
    assert calls == [("roneneldan/TinyStories", "validation", True), ("roneneldan/TinyStories", "train", False)]


def test_unknown_source_corpus_or_local_validation_split_raises():
    with pytest.raises(ValueError, match="known sources"):
        load_stories("s3")
    with pytest.raises(ValueError, match="known corpora"):
        load_tokens("wikipedia")
    with pytest.raises(ValueError, match="'train' split only"):
        load_stories("local", split="validation")


def test_empty_corpus_raises(tmp_path, monkeypatch):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    monkeypatch.setitem(data.FILES, "tinystories", empty)
    with pytest.raises(ValueError, match="empty"):
        load_text("tinystories")
    with pytest.raises(ValueError, match="too few"):
        get_batch(torch.tensor([], dtype=torch.long), 1, 8, 0)


def test_token_stream_is_bos_then_story_for_every_story(tokens):
    tok = get_tokenizer()
    stories = load_stories()
    assert tokens.dtype == torch.long and tokens.dim() == 1
    assert int((tokens == tok.bos_id).sum()) == len(stories)
    second_bos = int((tokens == tok.bos_id).nonzero()[1])
    assert tokens[0] == tok.bos_id and tok.decode(tokens[1:second_bos]) == stories[0]
    assert int(tokens.max()) < tok.vocab_size


def test_load_tokens_reads_the_disk_cache_without_encoding_again(tmp_path, monkeypatch, tokens):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(data, "_TOKENS", {})
    monkeypatch.setattr(data, "_encode", lambda *a: tokens)  # pretend to encode: fast
    load_tokens("tinystories")
    assert len(list(tmp_path.glob("tinystories-*.npy"))) == 1

    def must_not_encode(*a):
        raise AssertionError("encoded again despite the disk cache")

    monkeypatch.setattr(data, "_TOKENS", {})
    monkeypatch.setattr(data, "_encode", must_not_encode)
    assert torch.equal(load_tokens("tinystories"), tokens)


def test_shakespeare_is_character_level_with_65_symbols():
    tok = get_tokenizer("shakespeare")
    stream = load_tokens("shakespeare")
    assert tok.vocab_size == 65 and len(stream) == len(load_text("shakespeare"))
    assert tok.decode(stream[:20]) == load_text("shakespeare")[:20]
    with pytest.raises(ValueError, match="not in this corpus's alphabet"):
        tok.encode("€")


def test_check_vocab_tokenizer_model_mismatch_raises():
    check_vocab(get_tokenizer(), get_config("tiny"))
    with pytest.raises(ValueError, match="vocab_size=65"):
        check_vocab(get_tokenizer("shakespeare"), get_config("tiny"))


def test_seq_longer_than_context_raises():
    cfg = get_config("tiny")
    check_seq_len(cfg, cfg.context)
    with pytest.raises(ValueError, match="context 128"):
        get_batch(torch.arange(10_000), 2, cfg.context + 1, 0, config=cfg)


def test_get_batch_targets_are_inputs_shifted_by_one_taken_from_the_stream(tokens):
    x, y = get_batch(tokens, 8, 32, step=3)
    assert x.shape == y.shape == (8, 32) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    # row i is window w_i of the stream: tokens[w_i * seq_len:][:seq_len]
    start = int(data.batch_windows((len(tokens) - 1) // 32, 8, 3)[0]) * 32
    assert torch.equal(x[0], tokens[start:start + 32]) and torch.equal(y[0], tokens[start + 1:start + 33])


def test_get_batch_reproducible_and_depends_on_step_and_seed(tokens):
    a = get_batch(tokens, 8, 32, step=5, seed=1)
    b = get_batch(tokens, 8, 32, step=5, seed=1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], get_batch(tokens, 8, 32, step=6, seed=1)[0])
    assert not torch.equal(a[0], get_batch(tokens, 8, 32, step=5, seed=2)[0])


@pytest.mark.parametrize("world_size", [2, 4])
def test_get_batch_ranks_get_disjoint_rows_whose_union_is_the_global_batch(tokens, world_size):
    gx, gy = get_batch(tokens, 8, 32, step=2)
    parts = [get_batch(tokens, 8, 32, step=2, rank=r, world_size=world_size) for r in range(world_size)]
    assert torch.equal(torch.cat([p[0] for p in parts]), gx)
    assert torch.equal(torch.cat([p[1] for p in parts]), gy)
    windows = data.batch_windows((len(tokens) - 1) // 32, 8, 2)
    assert len(set(windows.tolist())) == 8  # distinct windows: the ranks' rows never overlap


def test_get_batch_no_window_repeats_within_an_epoch_then_a_new_order():
    n = 50
    seen = torch.cat([data.batch_windows(n, 5, s) for s in range(10)])
    assert sorted(seen.tolist()) == list(range(n))
    assert not torch.equal(data.batch_windows(n, 5, 10), data.batch_windows(n, 5, 0))


def test_get_batch_global_batch_not_divisible_by_world_size_raises(tokens):
    with pytest.raises(ValueError, match="does not divide over world_size=3"):
        get_batch(tokens, 8, 32, 0, rank=0, world_size=3)
    with pytest.raises(ValueError, match="rank must be in"):
        get_batch(tokens, 8, 32, 0, rank=2, world_size=2)


def test_split_tokens_holds_out_the_tail(tokens):
    train, val = split_tokens(tokens, 0.1)
    assert len(train) + len(val) == len(tokens) and math.isclose(len(val) / len(tokens), 0.1, abs_tol=1e-4)
    assert torch.equal(torch.cat([train, val]), tokens)
