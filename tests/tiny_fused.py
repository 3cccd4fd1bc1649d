"""Source text that builds the tiny fused llama the Triton subprocess tests decode with (2 layers, 4 query and 2 KV
heads of 32, random N(0, 0.05) weights, seed 0, QKV and gate/up fused): prepended to their scripts, which run
under TRITON_INTERPRET=1 in a fresh interpreter and so cannot import a fixture.  Defines ``torch``, ``cfg`` and
``model``."""

TINY_FUSED_MODEL = """
import torch
from swiftlm.backends.torch.model import Transformer
from swiftlm.backends.torch.model_config import Args
cfg = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=32, intermediate_size=256, vocab_size=512, rms_norm_eps=1e-5, rope_theta=10000.0,
           max_position_embeddings=256, tie_word_embeddings=True)
torch.manual_seed(0)
model = Transformer(Args.from_config(cfg))
with torch.no_grad():
    for p_ in model.parameters():
        p_.normal_(0, 0.05)
model.eval(); model.init_rope()
with torch.no_grad():
    for blk in model.layers:
        blk.self_attn.fuse(); blk.mlp.fuse()
"""
