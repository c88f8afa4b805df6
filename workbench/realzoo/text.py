"""Hugging Face language models from tiny configs (random weights, nothing downloaded).

Each builder returns ``nn.Module`` mapping token ids (n, T) to logits: (n, T, V) for the
causal and sequence-to-sequence models (``next_token_loss``), (n, K) for the encoders with a
classification head. Sizes: hidden 16-32, 1-2 layers, vocabulary 32, so a float64
one-sample-at-a-time reference loop over every method stays in seconds.
"""

import importlib

from torch import nn

from workbench.realzoo import sizes
from workbench.realzoo.imports import import_transformers

VOCAB, HIDDEN, CLASSES = 32, 16, 3
SMALL = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
             intermediate_size=32, max_position_embeddings=16)


class Logits(nn.Module):
    """``hf(input_ids=x).logits``: a Hugging Face model as ids -> logits.

    Sequence-to-sequence models get ``decoder_input_ids = ids`` (teacher forcing on the same
    sequence: the decoder reads the encoder's output through cross-attention)."""

    def __init__(self, hf: nn.Module, seq2seq: bool = False):
        super().__init__()
        self.hf, self.seq2seq = hf, seq2seq

    def forward(self, ids):
        if self.seq2seq:
            return self.hf(input_ids=ids, decoder_input_ids=ids, use_cache=False).logits
        return self.hf(input_ids=ids).logits


def build(config_name: str, model_name: str, seq2seq: bool = False, **config) -> nn.Module:
    transformers = import_transformers()
    cfg = getattr(transformers, config_name)(**sizes.scaled(config))  # tiny, or base
    cfg.use_cache = False
    hf = getattr(transformers, model_name)(cfg)
    return Logits(hf.eval(), seq2seq)


def llama_like(kind: str, **extra):
    cfg = dict(SMALL, num_key_value_heads=1, **extra)
    return build(f"{kind}Config", f"{kind}ForCausalLM", **cfg)


def gpt2():
    return build("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1,
                 n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                 bos_token_id=1, eos_token_id=1)  # within the vocabulary


def gpt_neox():
    return build("GPTNeoXConfig", "GPTNeoXForCausalLM", **SMALL)


def phi():
    return build("PhiConfig", "PhiForCausalLM", **SMALL)


def gemma():
    return llama_like("Gemma", head_dim=8)


def qwen3():
    return llama_like("Qwen3", head_dim=8)


def opt():
    return build("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
                 num_hidden_layers=1, num_attention_heads=2, ffn_dim=32, word_embed_proj_dim=HIDDEN,
                 max_position_embeddings=16, dropout=0.0)


def bloom():
    return build("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
                 n_layer=1, n_head=2)


def mamba():
    return build("MambaConfig", "MambaForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
                 state_size=4, num_hidden_layers=1, expand=2, conv_kernel=2)


def encoder(kind: str, **extra):
    cfg = dict(SMALL, num_labels=CLASSES, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, **extra)
    return build(f"{kind}Config", f"{kind}ForSequenceClassification", **cfg)


def distilbert():
    return build("DistilBertConfig", "DistilBertForSequenceClassification", vocab_size=VOCAB,
                 dim=HIDDEN, n_layers=1, n_heads=2, hidden_dim=32, max_position_embeddings=16,
                 num_labels=CLASSES, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)


def t5():
    return build("T5Config", "T5ForConditionalGeneration", seq2seq=True, vocab_size=VOCAB,
                 d_model=HIDDEN, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                 relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0)


def bart():
    return build("BartConfig", "BartForConditionalGeneration", seq2seq=True, vocab_size=VOCAB,
                 d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                 max_position_embeddings=16, dropout=0.0)


def mixtral():
    """Mixture of experts: a top-2 router over 4 experts per token, the experts' weights as 3-D
    parameters (E, 2I, d), each token's k experts' weights gathered and applied by one bmm
    (Hugging Face's "batched_mm" experts; the default "grouped_mm" has no float64 kernel on
    CPU, "eager" loops over the experts hit, which vmap cannot run)."""
    return llama_like("Mixtral", num_local_experts=4, num_experts_per_tok=2,
                      experts_implementation="batched_mm")


def mamba2():
    """Mamba-2: the SSD scan, and a gated RMSNorm called as norm(y, gate)."""
    return build("Mamba2Config", "Mamba2ForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
                 num_hidden_layers=1, state_size=4, expand=2, num_heads=4, head_dim=8,
                 n_groups=1, conv_kernel=2, chunk_size=4)


def albert():
    """ALBERT: one layer's weights shared across depth (2 layers, 1 group): each shared module
    is called twice per forward pass."""
    return encoder("Albert", num_hidden_layers=2, embedding_size=8, num_hidden_groups=1,
                   inner_group_num=1)


def deberta():
    """DeBERTa (v1) with disentangled relative attention: ``DisentangledSelfAttention`` owns
    q_bias and v_bias, reads the relative embeddings' table, and returns (output, None)."""
    return encoder("Deberta", relative_attention=True, max_relative_positions=2,
                   pos_att_type=["c2p", "p2c"])


def lora_llama():
    base = llama_like("Llama")  # first: import_transformers' torchvision stand-in (imports.py)
    # must be in place before peft imports transformers itself
    peft = importlib.import_module("peft")
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                          lora_dropout=0.0)
    base.hf = peft.get_peft_model(base.hf, cfg)
    return base


CAUSAL = {
    "gpt2": gpt2, "gpt_neox": gpt_neox, "llama": lambda: llama_like("Llama"),
    "mistral": lambda: llama_like("Mistral"), "qwen2": lambda: llama_like("Qwen2"),
    "qwen3": qwen3, "phi": phi, "gemma": gemma, "opt": opt, "bloom": bloom, "mamba": mamba,
    "lora_llama": lora_llama, "t5": t5, "bart": bart, "mixtral": mixtral, "mamba2": mamba2,
}
"""name -> builder of an ids -> (n, T, V) logits model (next-token loss)."""


def mpnet():
    """MPNet: a relative position bias computed once, expanded to the batch size (n, H, T, T)
    and added to every layer's scores (``per_sample/broadcast.py``, ``widened``)."""
    return encoder("MPNet")  # its 32 buckets are fixed in compute_position_bias


CLASSIFIERS = {
    "bert": lambda: encoder("Bert"), "roberta": lambda: encoder("Roberta", pad_token_id=1),
    "distilbert": distilbert, "mpnet": mpnet, "albert": albert, "deberta": deberta,
}
"""name -> builder of an ids -> (n, K) logits model (cross-entropy on a label)."""


__all__ = [
    "CAUSAL", "CLASSIFIERS", "SMALL", "Logits", "albert", "bart", "bloom", "build", "deberta",
    "distilbert", "encoder", "gemma", "gpt2", "gpt_neox", "llama_like", "lora_llama", "mamba",
    "mamba2", "mixtral", "mpnet", "opt", "phi", "qwen3", "t5",
]
