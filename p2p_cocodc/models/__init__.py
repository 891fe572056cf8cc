"""Models and data: GPT presets, Hugging Face models, the corpus and tokenizers, saved models."""
