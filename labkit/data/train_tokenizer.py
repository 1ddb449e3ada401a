"""Re-create the shipped SentencePiece tokenizer: `python -m labkit.data.train_tokenizer`.

    python -m labkit.data.train_tokenizer            # writes labkit/assets/tokenizer.model
    python -m labkit.data.train_tokenizer --check    # trains in memory, compares with the shipped file

A byte-pair-encoding model with 4096 pieces (VOCAB_SIZE) trained on the shipped
TinyStories sample, with llama2.c's options: byte fallback (any text encodes, unknown
characters become their UTF-8 bytes), digits split, no text normalisation. Ids: 0 <unk>,
1 <s> (BOS, put before every story), 2 </s>, 3..258 the 256 byte pieces.

Deterministic: one thread, the corpus in file order, no sampling or shuffling of
sentences, so training twice gives byte-identical model files (tested).
Takes about a second.
"""
from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TOKENIZER_PATH = ASSETS / "tokenizer.model"
CORPUS_PATH = ASSETS / "tinystories-sample.txt"
VOCAB_SIZE = 4096
EOT = "<|endoftext|>"


def training_sentences(corpus: Path = CORPUS_PATH) -> list[str]:
    """Every non-empty paragraph line of the corpus, story separators dropped."""
    text = corpus.read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip() and line.strip() != EOT]


def train(vocab_size: int = VOCAB_SIZE, corpus: Path = CORPUS_PATH) -> bytes:
    """Train and return the serialized SentencePiece model."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_sentences(corpus)),
        model_writer=out,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        # determinism: single thread, all sentences, in order
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        seed_sentencepiece_size=1_000_000,
        max_sentence_length=8192,
        minloglevel=2,
    )
    return out.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--out", type=Path, default=TOKENIZER_PATH)
    parser.add_argument("--check", action="store_true", help="compare with the file at --out, write nothing")
    args = parser.parse_args(argv)
    model = train(args.vocab_size)
    if args.check:
        same = args.out.exists() and args.out.read_bytes() == model
        print(f"{args.out}: {'identical' if same else 'DIFFERENT'} ({len(model)} bytes trained)")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(model)
    print(f"wrote {args.out} ({len(model)} bytes, vocab {args.vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
