"""The lab's data: TinyStories (and tiny-shakespeare), tokenizers, and (batch, seq) blocks.

    from labkit.data import load_tokens, get_tokenizer, get_batch
    tokens = load_tokens("tinystories")                       # 1-D LongTensor, cached
    x, y = get_batch(tokens, batch_size=16, seq_len=128, step=0)        # the global batch
    x, y = get_batch(tokens, 16, 128, step=0, rank=1, world_size=4)     # rank 1's 4 rows of it

Corpora (`name`):
    tinystories  the shipped 2 MB sample (2,316 stories, CDLA-Sharing-1.0, see assets/NOTICE.md),
                 encoded with the shipped SentencePiece BPE tokenizer (4096 pieces); every story
                 is preceded by BOS (id 1), so the stream reads <s> story <s> story ...
    shakespeare  tiny-shakespeare (public domain), character level: 65 symbols, ids in sorted order.

Sources (`source`, TinyStories only): "local" (default, offline: the shipped file),
"datasets-local" (the shipped file read through `datasets.load_dataset("text", ...)`, the
code path of the hub, offline), "hub" (`datasets.load_dataset("roneneldan/TinyStories")`,
needs the internet; with max_stories it streams only those rows).

Batches and sharding: the seed rule
-----------------------------------
The token stream is cut into n = (len(tokens) - 1) // seq_len non-overlapping windows;
window w gives x = tokens[w*seq_len : (w+1)*seq_len] and y = the same shifted by one token.
Epoch e visits the windows in the order torch.randperm(n) drawn from
torch.Generator().manual_seed(seed * 1_000_003 + e). The global batch of step s is the
samples i = s*batch_size ... (s+1)*batch_size - 1, sample i being window number i % n of
epoch i // n's order. Rank r of world_size W gets rows r*b : (r+1)*b of it, b = batch_size / W.
So: the batch depends only on (tokens, batch_size, seq_len, step, seed), every process can
compute it with no communication, ranks get disjoint rows whose union is the global batch,
and no window repeats within an epoch.
"""
from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

ASSETS = Path(__file__).resolve().parents[1] / "assets"
FILES = {"tinystories": ASSETS / "tinystories-sample.txt", "shakespeare": ASSETS / "tinyshakespeare.txt"}
TOKENIZER_PATH = ASSETS / "tokenizer.model"
SOURCES = ("local", "datasets-local", "hub")
HUB_DATASET = "roneneldan/TinyStories"
EOT = "<|endoftext|>"


def _check_name(name: str) -> None:
    if name not in FILES:
        raise ValueError(f"unknown corpus {name!r}; known corpora: {sorted(FILES)}")


def cache_dir() -> Path:
    """Where encoded token streams are kept: $LABKIT_CACHE, else ~/.cache/labkit."""
    return Path(os.environ.get("LABKIT_CACHE") or Path.home() / ".cache" / "labkit")


# ---------------------------------------------------------------------------------------
# Text


def _normalise(story: str) -> str:
    """One story, paragraphs separated by one "\\n", no blank lines or trailing spaces."""
    return "\n".join(p.strip() for p in story.split("\n") if p.strip())


def load_text(name: str = "tinystories") -> str:
    """The shipped corpus file as one string."""
    _check_name(name)
    text = FILES[name].read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"corpus {name!r} ({FILES[name]}) is empty")
    return text


def load_stories(source: str = "local", split: str = "train", max_stories: int | None = None,
                 cache_dir: str | Path | None = None) -> list[str]:
    """TinyStories as a list of stories (paragraphs separated by "\\n"), in corpus order.

    source: "local" | "datasets-local" | "hub" (see the module docstring). `split` is for the
    hub ("train" or "validation"); the shipped sample is part of "train". `cache_dir` is
    passed to `datasets.load_dataset` (default: a temporary directory for "datasets-local").
    """
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; known sources: {list(SOURCES)}")
    if source != "hub" and split != "train":
        raise ValueError(f"the shipped sample is part of the 'train' split only, got split={split!r}; "
                         "use source='hub' for the validation split")
    if source == "local":
        stories = load_text("tinystories").split(EOT)
    elif source == "datasets-local":
        import datasets

        with tempfile.TemporaryDirectory() as tmp:  # keep the arrow cache out of the user's ~/.cache
            ds = datasets.load_dataset("text", data_files=str(FILES["tinystories"]), split="train",
                                       cache_dir=str(cache_dir or tmp))
            lines = ds["text"]
        stories = "\n".join(lines).split(EOT)  # rows are the file's lines
    else:
        import datasets

        if max_stories is None:  # the whole split: about 2 GB to download the first time
            stories = datasets.load_dataset(HUB_DATASET, split=split, cache_dir=cache_dir)["text"]
        else:  # stream: only the first max_stories rows travel
            stream = datasets.load_dataset(HUB_DATASET, split=split, streaming=True)
            stories = [row["text"] for row in stream.take(max_stories)]
        # (the hub separates paragraphs with a blank line, the .txt file with one "\n": normalised below)
    stories = [s for s in map(_normalise, stories) if s]
    if max_stories is not None:
        stories = stories[:max_stories]
    if not stories:
        raise ValueError(f"no stories loaded from source={source!r}, split={split!r}: the corpus is empty")
    return stories


# ---------------------------------------------------------------------------------------
# Tokenizers


class Tokenizer:
    """The shipped SentencePiece model (4096 BPE pieces, byte fallback): encode/decode/vocab_size."""

    def __init__(self, path: str | Path = TOKENIZER_PATH):
        import sentencepiece as spm

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run `python -m labkit.data.train_tokenizer`")
        self.path = path
        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self.sp.vocab_size()
        self.bos_id = self.sp.bos_id()

    def encode(self, text: str, bos: bool = False) -> list[int]:
        return ([self.bos_id] if bos else []) + self.sp.encode(text)

    def decode(self, ids) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self.sp.decode([i for i in ids if i != self.bos_id])

    def __repr__(self):
        return f"Tokenizer(sentencepiece bpe, vocab_size={self.vocab_size})"


class CharTokenizer:
    """Character-level tokenizer: one id per distinct character of the corpus, in sorted order."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        self.bos_id = None
        self._ids = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str, bos: bool = False) -> list[int]:
        if bos:
            raise ValueError("the character tokenizer has no BOS token")
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in this corpus's alphabet") from None

    def decode(self, ids) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(self.chars[i] for i in ids)

    def __repr__(self):
        return f"CharTokenizer(vocab_size={self.vocab_size})"


@functools.lru_cache(maxsize=None)
def get_tokenizer(name: str = "tinystories"):
    """The tokenizer of a corpus: SentencePiece for tinystories, characters for shakespeare."""
    _check_name(name)
    return Tokenizer() if name == "tinystories" else CharTokenizer(load_text("shakespeare"))


def check_vocab(tokenizer, config) -> None:
    """ValueError unless the tokenizer's vocabulary is the model's (config.vocab_size)."""
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                         f"{config.vocab_size}: build the model with "
                         f"get_config(name, vocab_size={tokenizer.vocab_size})")


def check_seq_len(config, seq_len: int) -> None:
    """ValueError unless 1 <= seq_len <= config.context."""
    if not 1 <= seq_len <= config.context:
        raise ValueError(f"seq_len={seq_len} must be between 1 and the model's context {config.context}")


# ---------------------------------------------------------------------------------------
# Token streams

_TOKENS: dict = {}  # in-memory cache of this process (ranks read the .npy cache on disk)
CACHE_VERSION = 1  # bump when the encoding rule (normalisation, BOS) changes: old cache files are then ignored


def _file_digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _encode(name: str, source: str, max_stories: int | None) -> torch.Tensor:
    tok = get_tokenizer(name)
    if name == "shakespeare":
        return torch.tensor(tok.encode(load_text(name)), dtype=torch.long)
    stories = load_stories(source, max_stories=max_stories)
    ids = []
    for encoded in tok.sp.encode(stories):  # batched encode: one call for the corpus
        ids.append(tok.bos_id)
        ids.extend(encoded)
    return torch.tensor(ids, dtype=torch.long)


def token_cache_path(name: str = "tinystories", max_stories: int | None = None) -> Path:
    """Where load_tokens keeps a shipped corpus's encoded tokens (uint16 .npy, a pre-tokenised shard).

    The name holds the corpus, the cache version and a digest of the corpus and tokenizer
    files, so a changed corpus or tokenizer is encoded again instead of read stale.
    """
    _check_name(name)
    digest = _file_digest(FILES[name], *([TOKENIZER_PATH] if name == "tinystories" else []))
    return cache_dir() / f"{name}-v{CACHE_VERSION}-{max_stories or 'all'}-{digest}.npy"


def load_tokens(name: str = "tinystories", source: str = "local", max_stories: int | None = None) -> torch.Tensor:
    """The corpus as one 1-D LongTensor of token ids (do not modify it in place: it is cached).

    Cached in memory, and for the shipped files on disk under `cache_dir()` keyed by the
    corpus and tokenizer contents, so the 2 MB corpus is encoded once per machine.
    """
    _check_name(name)
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; known sources: {list(SOURCES)}")
    if name == "shakespeare" and source != "local":
        raise ValueError("tiny-shakespeare is only shipped locally: use source='local'")
    key = (name, source, max_stories)
    if key in _TOKENS:
        return _TOKENS[key]
    path = token_cache_path(name, max_stories) if source == "local" else None
    if path is not None and path.exists():
        tokens = torch.from_numpy(np.load(path).astype(np.int64))
    else:
        tokens = _encode(name, source, max_stories)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")  # atomic: ranks may race here
            np.save(tmp, tokens.numpy().astype(np.uint16))
            os.replace(tmp, path)
    if tokens.numel() < 2:
        raise ValueError(f"corpus {name!r} has {tokens.numel()} tokens: it is empty")
    _TOKENS[key] = tokens
    return tokens


def split_tokens(tokens: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the last `val_fraction` of the stream is held out."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


@functools.lru_cache(maxsize=64)
def _epoch_order(n_windows: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_windows, generator=g)


def batch_windows(n_windows: int, batch_size: int, step: int, seed: int = 0) -> torch.Tensor:
    """Window numbers of the global batch of `step` (the seed rule of the module docstring)."""
    samples = range(step * batch_size, (step + 1) * batch_size)
    return torch.stack([_epoch_order(n_windows, seed, i // n_windows)[i % n_windows] for i in samples])


def get_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, step: int, seed: int = 0, *,
              rank: int = 0, world_size: int = 1, config=None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), each [batch_size / world_size, seq_len] LongTensors, y = x shifted by one token.

    `batch_size` is the GLOBAL batch; rank `rank` of `world_size` gets its rows
    rank*b:(rank+1)*b (b = batch_size // world_size). Deterministic in (tokens, batch_size,
    seq_len, step, seed): see the seed rule in the module docstring. Pass the model's
    `config` to check seq_len against its context.
    """
    if config is not None:
        check_seq_len(config, seq_len)
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D stream of token ids, got shape {tuple(tokens.shape)}")
    if seq_len < 1 or batch_size < 1 or step < 0:
        raise ValueError(f"need seq_len >= 1, batch_size >= 1, step >= 0; got {seq_len}, {batch_size}, {step}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    if batch_size % world_size:
        raise ValueError(f"the global batch_size={batch_size} does not divide over world_size={world_size} "
                         f"ranks: use a multiple of {world_size}")
    n_windows = (len(tokens) - 1) // seq_len
    if n_windows < batch_size:
        raise ValueError(f"the corpus has {len(tokens)} tokens: too few for {batch_size} windows of "
                         f"{seq_len}+1 tokens (an empty or tiny corpus?)")
    b = batch_size // world_size
    windows = batch_windows(n_windows, batch_size, step, seed)[rank * b:(rank + 1) * b]
    idx = windows[:, None] * seq_len + torch.arange(seq_len + 1)
    chunk = tokens[idx]
    x, y = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # .view(-1) works on both
    if device is not None:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x, y
