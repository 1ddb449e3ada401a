"""The lab's data: TinyStories and tiny-shakespeare, the SentencePiece tokenizer, (batch, seq) blocks.

    from labkit.data import load_tokens, get_tokenizer, get_batch

The names below are `labkit.data.corpus`'s public API, re-exported here; patch or read module state
(the token cache) in `labkit.data.corpus` itself. `python -m labkit.data.train_tokenizer` re-creates
the shipped tokenizer.
"""
from labkit.data.corpus import (ASSETS, CACHE_VERSION, EOT, FILES, HUB_DATASET, SOURCES, TOKENIZER_PATH,
                                CharTokenizer, Tokenizer, batch_windows, cache_dir, check_seq_len,
                                check_vocab, get_batch, get_tokenizer, load_stories, load_text,
                                load_tokens, split_tokens, token_cache_path)

__all__ = ["ASSETS", "CACHE_VERSION", "EOT", "FILES", "HUB_DATASET", "SOURCES", "TOKENIZER_PATH",
           "CharTokenizer", "Tokenizer", "batch_windows", "cache_dir", "check_seq_len", "check_vocab",
           "get_batch", "get_tokenizer", "load_stories", "load_text", "load_tokens", "split_tokens",
           "token_cache_path"]
