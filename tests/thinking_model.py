"""A tiny random Qwen3 whose replies are forced: it thinks, then answers, every time.

Built for the tests (never downloaded): transformers' ``Qwen3Config`` with two layers, the
bundled tokenizer plus Qwen3's ``<think>``/``</think>`` tokens, and a chat template in
Qwen3's format written here (``enable_thinking=False`` closes an empty think block in the
generation prompt, as Qwen3's does). Unlike Qwen3's own template it renders earlier
assistant turns verbatim, so a test sees any thinking the app sends back.

The weights make it a bigram model: every attention and MLP output projection is zero, so
the last position's hidden state is its token's embedding, and the LM head maps each token
of the script to the next one. Greedy or sampled at the page's temperatures, it writes

    <think>Hmm, the capital of France</think>Paris!<|im_end|>       (thinking on)
    Paris!<|im_end|>                                                (thinking off)

Built ``endless``, it thinks "Hmm, the capital of France" over and over (a long window, no
answer) until the token limit or a Stop: a reply that is stopped mid-thought.
"""

from __future__ import annotations

import itertools
from pathlib import Path

THINKING = "Hmm, the capital of France"
ANSWER = "Paris!"

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def build_thinking_qwen3(path: Path, tokenizer, endless: bool = False) -> Path:
    """Save the model, tokenizer and template to ``path`` (``tokenizer`` is copied, not changed).
    ``endless``: with thinking on it thinks in a loop, never answering (until the token limit)."""
    import copy

    import torch
    from transformers import AddedToken, Qwen3Config, Qwen3ForCausalLM

    from workers.generation.prompt import encode_chat
    from workers.protocol import ChatMessage

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    tok.chat_template = CHAT_TEMPLATE
    ask = [ChatMessage("user", "What is the capital of France?")]
    after_on = encode_chat(tok, ask)[-1]  # the generation prompt's last token, thinking on ...
    after_off = encode_chat(tok, ask, enable_thinking=False)[-1]  # ... and off
    think, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    thinking = tok(THINKING, add_special_tokens=False).input_ids
    answer = tok(ANSWER, add_special_tokens=False).input_ids
    script = [after_on, think, *thinking, end, *answer, end_of_turn]
    successor = dict(itertools.pairwise(script))
    successor[after_off] = answer[0]
    if endless:
        successor[thinking[-1]] = thinking[0]
    assert len(set(script)) == len(script) and after_off not in script, "the script's tokens must be unique"

    hidden = 64
    config = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=4096 if endless else 512,
                         tie_word_embeddings=False, eos_token_id=end_of_turn, bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for slot, (token, following) in enumerate(successor.items()):
            model.model.embed_tokens.weight[token, slot] = 1.0
            model.lm_head.weight[following, slot] = 10.0  # logit 10·√hidden after the final RMSNorm
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
