"""A Llama folder for ``--model hf:OUT``: config.json (no weights: a run builds them from its seed) and
the project's shipped BPE tokenizer (4096 tokens), written as ``save_pretrained`` writes them. The
defaults are the ~317 M-parameter Llama the GPU benchmarks train (untied embeddings, as many
key/value heads as heads); the parameter count, from the model built on the meta device, is printed.

    python benchmarks/llama_folder.py /tmp/llama317
    python benchmarks/llama_folder.py /tmp/tiny --hidden 64 --layers 2 --heads 2 --intermediate 128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--max-positions", type=int, default=2048)
    args = parser.parse_args()

    import torch
    import transformers
    from tokenizers import Tokenizer

    from p2p_cocodc.models.data import SHIPPED_BPE

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=False,
    )
    config.save_pretrained(args.out)
    backend = Tokenizer.from_str(SHIPPED_BPE.read_text(encoding="utf-8"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(args.out)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: Llama, {args.layers} layers × {args.hidden} wide, {params / 1e6:.1f} M parameters")


if __name__ == "__main__":
    main()
