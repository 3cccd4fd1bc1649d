"""Tokenizers for both backends, built with the ``tokenizers`` library only.

Sources: an HF-format directory (``tokenizer.json`` + ``tokenizer_config.json``) or the
metadata of a GGUF file (vocab, merges, token types, special ids, chat template), so the
GGUF path needs neither transformers nor torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .chat.template import ChatTemplate
from .errors import CorruptModel, UnsupportedArchitecture

# llama.cpp pre-tokenizer names whose regex splits digits one by one (as the original
# HF tokenizers of these models do with a Digits(individual_digits=True) step).
_INDIVIDUAL_DIGIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}

# llama.cpp pre-tokenizer names whose HF tokenizer.json splits with its own regex (a Split step, then
# ByteLevel without the GPT-2 regex): Qwen2 / Qwen2.5 / Qwen3 ("qwen2") and Llama 3 ("llama-bpe").
_SPLIT_PRE = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}

GGUF_TOKEN_CONTROL = 3
GGUF_TOKEN_USER_DEFINED = 4


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: set[int]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str: ...


KEPT_MARKERS = (
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    "<think>",
    "</think>",
    "[THINK]",
    "[/THINK]",
    "◁think▷",
    "◁/think▷",
    "<seed:think>",
    "</seed:think>",
)


@dataclass
class HFTokenizer:
    """A ``tokenizers.Tokenizer`` plus special ids and the chat template."""

    tok: Any
    eos_token_ids: set[int]
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False
    chat_template: ChatTemplate | None = None
    special_ids: set[int] = field(default_factory=set)
    _kept: set[int] | None = field(default=None, repr=False)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token:
            bos = self.tok.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        keep = self.kept_special_ids
        if not skip_special_tokens or not keep or keep.isdisjoint(ids):
            return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        # tool-call and thinking markers are special tokens in some vocabularies (Mistral's
        # [TOOL_CALLS], Llama's <|python_tag|>): keep them so the output parser can see them
        parts, start = [], 0
        for i, t in enumerate(ids):
            if t in keep:
                parts.append(self.tok.decode(ids[start:i], skip_special_tokens=True))
                parts.append(self.tok.id_to_token(t))
                start = i + 1
        parts.append(self.tok.decode(ids[start:], skip_special_tokens=True))
        return "".join(parts)

    @property
    def kept_special_ids(self) -> set[int]:
        if self._kept is None:
            found = {self.tok.token_to_id(m) for m in KEPT_MARKERS}
            self._kept = {i for i in found if i is not None and i in self.special_ids}
        return self._kept

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if self.chat_template is None:
            raise UnsupportedArchitecture("this model has no chat template; use a plain completion prompt")
        return self.chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    # --- serialisation (used by `swiftlm convert`) -------------------------------------
    def save_pretrained(self, out: Path) -> None:
        out = Path(out)
        self.tok.save(str(out / "tokenizer.json"))
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 30,
        }
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template.source
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def _token_str(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def load_hf_tokenizer(path: Path, config: dict | None = None) -> HFTokenizer:
    from tokenizers import Tokenizer as RawTokenizer

    path = Path(path)
    tj = path / "tokenizer.json"
    if not tj.exists():
        raise CorruptModel(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
    try:
        tok = RawTokenizer.from_file(str(tj))
    except Exception as exc:
        raise CorruptModel(f"{tj} could not be read: {exc}") from exc
    tcfg: dict = {}
    if (path / "tokenizer_config.json").exists():
        tcfg = json.loads((path / "tokenizer_config.json").read_text())
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    elif (path / "chat_template.json").exists():
        template = json.loads((path / "chat_template.json").read_text()).get("chat_template", template)
    bos = _token_str(tcfg.get("bos_token"))
    eos = _token_str(tcfg.get("eos_token"))
    eos_ids: set[int] = set()
    cfg_eos = (config or {}).get("eos_token_id")
    if isinstance(cfg_eos, int):
        eos_ids.add(cfg_eos)
    elif isinstance(cfg_eos, list):
        eos_ids.update(int(i) for i in cfg_eos)
    if eos and tok.token_to_id(eos) is not None:
        eos_ids.add(tok.token_to_id(eos))
    special = _special_ids(tok)
    return HFTokenizer(
        tok,
        eos_ids,
        bos,
        eos,
        bool(tcfg.get("add_bos_token", False)),
        ChatTemplate(template) if template else None,
        special,
    )


def _special_ids(tok: Any) -> set[int]:
    try:
        return {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    except AttributeError:  # older tokenizers
        return set()


def load_gguf_tokenizer(meta: dict[str, Any]) -> HFTokenizer:
    """Build a byte-level BPE tokenizer from GGUF metadata (``tokenizer.ggml.*``)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedArchitecture(
            f"GGUF tokenizer model {kind!r} is not supported yet (supported: 'gpt2' byte-level BPE); "
            "convert the model to an HF directory instead"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges_raw: list[str] = meta.get("tokenizer.ggml.merges", [])
    types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    tok = RawTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    pre = meta.get("tokenizer.ggml.pre")
    if pre in _SPLIT_PRE:
        from tokenizers import Regex

        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
    elif pre in _INDIVIDUAL_DIGIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED)
    ]
    tok.add_special_tokens(special)

    def tok_at(key: str) -> str | None:
        i = meta.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    eos_ids = {int(meta["tokenizer.ggml.eos_token_id"])} if "tokenizer.ggml.eos_token_id" in meta else set()
    if "tokenizer.ggml.eot_token_id" in meta:
        eos_ids.add(int(meta["tokenizer.ggml.eot_token_id"]))
    template = meta.get("tokenizer.chat_template")
    return HFTokenizer(
        tok,
        eos_ids,
        bos_token=tok_at("tokenizer.ggml.bos_token_id"),
        eos_token=tok_at("tokenizer.ggml.eos_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=ChatTemplate(template) if template else None,
        special_ids={vocab[t.content] for t in special},
    )
