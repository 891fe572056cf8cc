"""Using a trained model (``p2p_cocodc.models.saved``): continue a prompt, and score a text.

Scoring goes through the very functions a run evaluates θ̄ with (the corpus split, the tokenized
validation stream, its fixed batches, ``evaluate``), so a saved model scored on its run's data with
its run's settings gives the run's final perplexity back.
"""

from __future__ import annotations

import torch
from torch import nn

from p2p_cocodc.algorithms.devices import Placement
from p2p_cocodc.algorithms.inner import evaluate
from p2p_cocodc.errors import UserError
from p2p_cocodc.models.data import Tokenizer, load_corpus, tokenize_corpus, validation_batches


def generate(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    generator: torch.Generator,
    context: int,
    device: torch.device,
) -> str:
    """``prompt`` and its continuation of ``max_new_tokens`` tokens. Each token is the likeliest
    (``temperature`` 0) or drawn with ``generator`` from the ``top_k`` likeliest (0: all), their
    logits divided by ``temperature``; the model sees at most the last ``context`` tokens."""
    ids = tokenizer.encode(prompt)
    if not ids:
        raise UserError("--prompt is empty: give some text for the model to continue")
    with torch.no_grad():
        for _ in range(max_new_tokens):
            window = torch.tensor([ids[-context:]], device=device)
            # ids past the tokenizer's (an hf: model's padded embedding) are never drawn
            logits = model(window)[0, -1, : tokenizer.vocab_size].float().cpu()
            ids.append(next_token(logits, temperature, top_k, generator))
    return tokenizer.decode(ids)


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def evaluate_text(
    model: nn.Module,
    tokenizer: Tokenizer,
    data: str | None,
    *,
    seq_len: int,
    batch_size: int,
    batches: int,
    placement: Placement,
) -> tuple[float, int]:
    """Mean validation loss of ``model`` on the validation split of ``data`` (None: the embedded
    corpus), and how many tokens it scored."""
    corpus = load_corpus(data)
    val = tokenize_corpus(corpus, tokenizer).val
    windows = validation_batches(val, seq_len, batch_size, batches)
    loss = evaluate(model.to(placement.device), windows, placement)
    return loss, sum(y.numel() for _, y in windows)
