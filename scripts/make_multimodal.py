"""Random-weight Gemma 4 (vision + audio) checkpoint in hub layout, for `make_checkpoint.py --arch gemma4`.

The model is built and saved by transformers' own Gemma4ForConditionalGeneration (so the weight
names and config are what the hub holds); the processor config nests transformers' Gemma4 image
processor and audio feature extractor, and the tokenizer is SmolLM2's plus Gemma 4's six media
special tokens.  Random weights: plumbing only, no output quality.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

SPECIAL = {
    "image_token": "<|image|>",
    "boi_token": "<|image_start|>",
    "eoi_token": "<|image_end|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio_start|>",
    "eoa_token": "<|audio_end|>",
}


def write_gemma4(
    out: Path,
    base_tokenizer: Any,
    *,
    hidden: int = 64,
    layers: int = 2,
    vision: bool = True,
    audio: bool = True,
    seed: int = 0,
    dtype: str = "float32",
    max_soft_tokens: int = 70,
) -> Path:
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    with tempfile.TemporaryDirectory() as tmp:
        base_tokenizer.save_pretrained(Path(tmp))
        tc = json.loads((Path(tmp) / "tokenizer_config.json").read_text())
        tok = PreTrainedTokenizerFast(
            tokenizer_file=str(Path(tmp) / "tokenizer.json"),
            bos_token=tc.get("bos_token"),
            eos_token=tc.get("eos_token"),
            pad_token="<|endoftext|>",
            extra_special_tokens=SPECIAL,
        )
        tok.chat_template = tc.get("chat_template")
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in SPECIAL.items()}
    vocab = len(tok)
    head = 32
    text = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head,
        global_head_dim=head,
        sliding_window=64,
        layer_types=(["sliding_attention", "full_attention"] * layers)[:layers],
        vocab_size_per_layer_input=vocab,
        hidden_size_per_layer_input=16,
        max_position_embeddings=8192,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        initializer_range=0.1,
    )
    vis = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=16,
        pooling_kernel_size=3,
        position_embedding_size=1024,
        initializer_range=0.1,
    )
    aud = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        subsampling_conv_channels=[128, 8],
        output_proj_dims=48,
        initializer_range=0.1,
    )
    cfg = Gemma4Config(
        text_config=text,
        vision_config=vis if vision else None,
        audio_config=aud if audio else None,
        image_token_id=ids["image_token"],
        boi_token_id=ids["boi_token"],
        eoi_token_id=ids["eoi_token"],
        audio_token_id=ids["audio_token"],
        boa_token_id=ids["boa_token"],
        eoa_token_index=ids["eoa_token"],
        video_token_id=ids["image_token"],
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # norms and scalars random too, so no weight is a trivial identity
        g = torch.Generator().manual_seed(seed + 1)
        for _, p in model.named_parameters():
            if p.dim() <= 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    out.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    tok.save_pretrained(out)
    conf = json.loads((out / "config.json").read_text())
    conf["text_config"]["global_head_dim"] = head  # mlx-vlm's default differs from transformers'
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    proc: dict[str, Any] = {
        "processor_class": "Gemma4Processor",
        "image_seq_length": max_soft_tokens,
        "audio_seq_length": 750,
        "audio_ms_per_token": 40,
    }
    if vision:
        proc["image_processor"] = Gemma4ImageProcessorPil(
            max_soft_tokens=max_soft_tokens, patch_size=16, pooling_kernel_size=3
        ).to_dict()
    if audio:
        proc["feature_extractor"] = Gemma4AudioFeatureExtractor().to_dict()
    (out / "processor_config.json").write_text(json.dumps(proc, indent=2, default=str))
    return out
