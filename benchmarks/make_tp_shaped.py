"""A random Llama with SmolLM2-135M's shapes (30 layers, hidden 576, MLP 1536, vocab 49152) but 8
query / 2 KV heads, so that it splits over 2 ranks (SmolLM2's own 9 / 3 heads split over 3 only),
with SmolLM2's tokenizer: `rayspec bench offline --tensor-parallel-size 2` times it. Its outputs
are meaningless; its step times are SmolLM2-sized.
Usage: python benchmarks/make_tp_shaped.py OUT_DIR"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rayspec.model.weights.hub import resolve_model_dir


def main(out: Path) -> None:
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_theta=100000.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for f in resolve_model_dir("smollm2-135m-instruct").iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
