"""Training for speculative decoding: distilled drafts (train-draft) and learned draft-length policies
(train-head, train-decision). torch + transformers only; ``jobs/train_*.py`` run these under Ray."""
