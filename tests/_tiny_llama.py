"""A tiny random Llama checkpoint with a word-level tokenizer ("w4".."w127"), for tests that
need string prompts without the course model (tests/engine/test_llm_api.py, test_api_properties.py)."""

import torch

VOCAB = 128
MAX_POS = 64
EOS = 2
# word-level vocabulary: special tokens 0-3, then "w4" .. "w127" (no word contains another)
WORDS = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}


def make_tiny_llama(path) -> str:
    """Write the checkpoint and tokenizer into ``path`` (seeded: the same weights every time)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(4.0)  # sharper logits: greedy choices are not near-ties
    hf.save_pretrained(path)
    tk = Tokenizer(models.WordLevel(WORDS, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(path)
    return str(path)
