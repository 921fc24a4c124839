"""Models that read parameters the ways real models do, for the any-model stage 3 tests.

Each builder takes a seed and returns ``(model, batch_fn, loss_fn)``: ``batch_fn(rank, step)``
gives the keyword arguments of one forward, ``loss_fn(output)`` the scalar loss. Dropout is
off everywhere so that zpp and the DDP reference draw no random numbers.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, T, BATCH = 64, 12, 4


def _tokens(rank: int, step: int, vocab: int = VOCAB, t: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randint(0, vocab, (BATCH, t), generator=g)


class FunctionalTiedLM(nn.Module):
    """A hand-written language model: the token embedding is read twice in one forward (by
    its own module, then through ``F.linear`` in this module's forward: functional weight
    tying), one block is applied twice (a module used twice), the blocks are
    ``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention`` reads ``out_proj.weight``
    without calling ``out_proj``), a 1-element parameter (smaller than the world), a frozen
    LayerNorm inside a block, a buffer, and a dict as output."""

    def __init__(self, d: int = 32, ckpt: str | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        nn.init.normal_(self.emb.weight, std=0.02)  # GPT-2's init: logits near zero, as in real LMs
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
                                    for _ in range(2))
        self.shared = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.blocks[0].norm1.requires_grad_(False)
        self.temperature = nn.Parameter(torch.ones(1))
        self.register_buffer("offset", torch.zeros(d))
        self.ckpt = ckpt

    def _run(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if self.ckpt is None or not torch.is_grad_enabled():
            return block(h)
        if self.ckpt == "deepspeed":  # deepspeed.checkpointing.checkpoint, as Megatron-style models call it
            import zpp.checkpointing

            return zpp.checkpointing.checkpoint(block, h)
        return checkpoint(block, h, use_reentrant=self.ckpt == "reentrant")

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        h = self.emb(input_ids) + self.offset
        for b in self.blocks:
            h = self._run(b, h)
        h = self._run(self.shared, self._run(self.shared, h))
        logits = F.linear(h, self.emb.weight) * self.temperature
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return out


class Seq2Seq(nn.Module):
    """``nn.Transformer``-style encoder-decoder from ``nn.TransformerEncoder`` and
    ``nn.TransformerDecoder`` stacks (cross-attention), with a tuple as output."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.src = nn.Embedding(VOCAB, d)
        self.tgt = nn.Embedding(VOCAB, d)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True), 2,
                                             enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids, decoder_input_ids, labels):
        memory = self.encoder(self.src(input_ids))
        mask = nn.Transformer.generate_square_subsequent_mask(decoder_input_ids.shape[1])
        logits = self.head(self.decoder(self.tgt(decoder_input_ids), memory, tgt_mask=mask, tgt_is_causal=True))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), logits


def functional_tied(seed: int, ckpt: str | None = None):
    torch.manual_seed(seed)
    return (FunctionalTiedLM(ckpt=ckpt), lambda r, s: {"input_ids": _tokens(r, s), "labels": _tokens(r, s + 10_000)},
            lambda out: out["loss"])


def seq2seq(seed: int):
    torch.manual_seed(seed)

    def batch(r, s):
        x = _tokens(r, s)
        return {"input_ids": x, "decoder_input_ids": x.roll(1, dims=1), "labels": x}

    return Seq2Seq(), batch, lambda out: out[0]


# --------------------------------------------------------------------------- Hugging Face
def _hf(kind: str, seed: int, ckpt: str | None = None):
    import transformers as tf

    common = {"vocab_size": VOCAB}
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **common)
        cls = tf.GPT2LMHeadModel
    elif kind == "bert":
        cfg = tf.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=32,
                            **common)
        cls = tf.BertForMaskedLM
    elif kind == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=64, max_position_embeddings=32, tie_word_embeddings=True,
                             bos_token_id=0, eos_token_id=0, **common)
        cls = tf.LlamaForCausalLM
    elif kind == "t5":
        cfg = tf.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_kv=16, num_heads=2, d_ff=64,
                          dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **common)
        cls = tf.T5ForConditionalGeneration
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg)
    if ckpt is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
    model.train()
    # causal LMs shift the labels themselves; the others get labels unrelated to the input,
    # so that no model can copy its input and drive the loss (and relative errors) to zero
    causal = kind in ("gpt2", "llama")
    return (model, lambda r, s: {"input_ids": _tokens(r, s), "labels": _tokens(r, s if causal else s + 10_000)},
            lambda out: out.loss)


def gpt2(seed, ckpt=None):
    return _hf("gpt2", seed, ckpt)


def bert(seed):
    return _hf("bert", seed)


def llama(seed):
    return _hf("llama", seed)


def t5(seed):
    return _hf("t5", seed)


MODELS = {
    "functional_tied": functional_tied,
    "functional_tied_ckpt": lambda s: functional_tied(s, "non_reentrant"),
    "functional_tied_ckpt_reentrant": lambda s: functional_tied(s, "reentrant"),
    "functional_tied_ckpt_deepspeed": lambda s: functional_tied(s, "deepspeed"),
    "seq2seq": seq2seq,
    "gpt2": gpt2,
    "gpt2_ckpt": lambda s: gpt2(s, "non_reentrant"),
    "gpt2_ckpt_reentrant": lambda s: gpt2(s, "reentrant"),
    "bert": bert,
    "llama": llama,
    "t5": t5,
}
