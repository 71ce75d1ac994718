"""Build the tiny random Qwen3-MoE that the real-engine tier serves, with a local tokenizer (no model hub access).

    DIR/venv/bin/python make_tiny_model.py DIR/model      (run by setup.sh, with the engine's own venv)

The model only has to exercise the code paths the gateway depends on: a real MoE router (so routed_experts are
real), log-probs, stop tokens and streaming. Its weights are random (seed 0) and its shape is as small as SGLang
accepts: 2 layers, 8 experts, top-2, hidden size 64, a 512-entry word-level vocabulary ("w0" ... "w508" and three
special tokens), so token ids are < 512 and a CPU generates a few dozen tokens per second. float32 throughout,
because the CPU engine runs with --dtype float32.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

VOCAB_SIZE = 512
MAX_LEN = 4096  # matches run.sh's --max-total-tokens


def build_tokenizer(out: str) -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(VOCAB_SIZE - 3)}
    vocab.update({"<unk>": VOCAB_SIZE - 3, "<|endoftext|>": VOCAB_SIZE - 2, "<|im_end|>": VOCAB_SIZE - 1})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # decodes words joined by spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=MAX_LEN,
    )
    # SGLang's chat endpoints want a template; the gateway never uses them, any template will do.
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(out)
    return fast


def build_model(out: str) -> None:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,  # every layer is an MoE layer: every routing row is real
        norm_topk_prob=True,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False,
        bos_token_id=VOCAB_SIZE - 2,
        eos_token_id=VOCAB_SIZE - 2,
        torch_dtype="float32",
    )
    Qwen3MoeForCausalLM(config).to(torch.float32).save_pretrained(out)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: make_tiny_model.py OUT_DIR")
    out = argv[0]
    os.makedirs(out, exist_ok=True)
    tokenizer = build_tokenizer(out)
    build_model(out)
    with open(os.path.join(out, "config.json")) as f:
        architectures = json.load(f)["architectures"]
    ids = tokenizer("w1 w2 w3")["input_ids"]
    print(f"{out}: {architectures}, {sorted(os.listdir(out))}; 'w1 w2 w3' -> {ids} -> {tokenizer.decode(ids)!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
