"""Training on one device: the loop (AdamW, warm-up + cosine, tokens/s) and checkpoints."""
