"""The model's shape, the dimensions that decide memory and what the fast path must know of the architecture, read
from its own config.json: a local folder's, or a hub id's from huggingface_hub's cache (or the Hub, where it can be
reached; the weights come later, if the plan lets them). A few hub ids the recipes name keep their shape in a table
(KNOWN_SHAPES) for machines where no config.json can be reached (offline tests, the CLI)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide memory: a decoder-only transformer with gated MLP and grouped-query attention."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool
    head_dim: int | None = None      # None: hidden // heads (Qwen3 sets 128 explicitly)
    qk_norm: bool = False            # Qwen3 normalises q and k per head
    attention_bias: bool = False     # Qwen2 has q/k/v biases
    # What the fast path must know of the architecture (freetune.plan.decisions steps a feature aside where it cannot
    # honour it); all from the model's config.json.
    model_type: str = ""
    sliding_window: int | None = None   # tokens a sliding-window layer attends to (None: no layer slides)
    attn_softcap: float | None = None   # attention logits soft-capped (Gemma-2): tanh(x / c) * c
    final_softcap: float | None = None  # output logits soft-capped (Gemma-2)
    layer_types: tuple = ()             # the layer types where layers differ ("full_attention", "sliding_attention")
    # Mixture of experts: per layer `experts` MLPs of expert_intermediate width, experts_per_token of them per token.
    # Their weights are 3-D parameters, not nn.Linear: bitsandbytes leaves them 16-bit.
    experts: int = 0
    expert_intermediate: int = 0
    experts_per_token: int = 0

    @property
    def q_dim(self) -> int:
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    def describe(self) -> str:
        """One line of what the plan must know of the model: its size and the architecture's particulars."""
        parts = [f"{self.total_params / 1e9:.2f} B parameters", f"{self.layers} layers",
                 "tied embeddings" if self.tied_embeddings else "untied embeddings"]
        if self.experts:
            parts.append(f"{self.experts} experts ({self.experts_per_token} per token, 16-bit)")
        if self.sliding_window:
            parts.append(f"sliding window {self.sliding_window}")
        if self.attn_softcap:
            parts.append(f"attention soft-cap {self.attn_softcap:g}")
        return f"{self.name} ({self.model_type or 'unknown type'}: {', '.join(parts)})"

    @property
    def per_layer_arguments(self) -> bool:
        """Whether decoder layers get different masks or rotary embeddings by layer type (Gemma-2/3 alternate sliding
        and full attention)."""
        return len(set(self.layer_types)) > 1

    @property
    def expert_params(self) -> int:
        """The experts' weights (gate, up and down per expert, every layer): kept 16-bit, not in 4 bits."""
        return self.layers * self.experts * 3 * self.hidden * self.expert_intermediate

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear layer in one decoder layer. A mixture of experts' MLP is counted
        at the width a token passes through (experts_per_token x expert_intermediate), for its activations."""
        h, i = self.hidden, self.intermediate
        if self.experts:
            i = self.experts_per_token * self.expert_intermediate
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def quantized_params(self) -> int:
        """Weights of the decoder layers' linear layers: what bitsandbytes stores in 4 bits."""
        return self.layers * sum(a * b for m, (a, b) in self.linear_dims().items()
                                 if m in ATTENTION_MODULES or not self.experts)  # experts: in expert_params

    @property
    def other_params(self) -> int:
        """Weights left in floating point: embeddings, an untied lm_head, norms, attention biases."""
        head_dim = self.head_dim or self.hidden // self.heads
        per_layer = 2 * self.hidden + (2 * head_dim if self.qk_norm else 0)
        if self.attention_bias:
            per_layer += self.q_dim + 2 * self.kv_dim
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        router = self.layers * self.hidden * self.experts
        return embeddings + self.layers * per_layer + self.hidden + self.expert_params + router

    @property
    def total_params(self) -> int:
        return self.quantized_params + self.other_params

    def lora_modules(self, targets: str | list[str] = "all-linear") -> list[str]:
        if targets == "all-linear":
            return list(LINEAR_MODULES)
        names = [targets] if isinstance(targets, str) else list(targets)
        unknown = [n for n in names if n not in LINEAR_MODULES]
        if unknown:
            raise ValueError(f"unknown LoRA target(s) {unknown}; expected 'all-linear' or names among "
                             f"{list(LINEAR_MODULES)}")
        return names

    def lora_params(self, rank: int, targets: str | list[str] = "all-linear") -> int:
        """Trainable LoRA parameters: rank x (in + out) per adapted linear layer."""
        dims = self.linear_dims()
        dense = self.layers * sum(rank * sum(dims[m]) for m in self.lora_modules(targets) if m in ATTENTION_MODULES
                                  or not self.experts)
        # peft 0.21's ParamWrapper on the experts' fused gate_up (2r per expert: hidden -> 2 x width) and down (r per
        # expert: width -> hidden), and a LoRA on the router (hidden -> experts); counted against peft in
        # tests/test_architectures.py
        experts = (self.layers * rank * (self.experts * (3 * self.hidden + 5 * self.expert_intermediate)
                                         + self.hidden + self.experts)
                   if self.experts and targets == "all-linear" else 0)
        return dense + experts

    @classmethod
    def from_config(cls, config, name: str | None = None) -> "ModelShape":
        """From a transformers config (or its dict), e.g. AutoConfig.from_pretrained(folder)."""
        cfg = _normalised(config) if isinstance(config, dict) else config.to_dict()
        cfg = cfg.get("text_config") or cfg  # multimodal configs nest the language model's
        model_type = cfg.get("model_type", "")
        layer_types = tuple(cfg.get("layer_types") or ())
        return cls(
            name=name or cfg.get("_name_or_path") or model_type or "model",
            hidden=cfg["hidden_size"],
            intermediate=cfg["intermediate_size"],
            layers=cfg["num_hidden_layers"],
            heads=cfg["num_attention_heads"],
            kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            vocab=cfg["vocab_size"],
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim=cfg.get("head_dim"),
            qk_norm=model_type.startswith("qwen3"),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            model_type=model_type,
            sliding_window=_sliding_window(cfg, layer_types),
            attn_softcap=cfg.get("attn_logit_softcapping"),
            final_softcap=cfg.get("final_logit_softcapping"),
            layer_types=tuple(sorted(set(layer_types))) if len(set(layer_types)) > 1 else (),
            experts=cfg.get("num_experts") or cfg.get("num_local_experts") or 0,
            expert_intermediate=cfg.get("moe_intermediate_size") or (
                cfg["intermediate_size"] if cfg.get("num_local_experts") else 0),
            experts_per_token=cfg.get("num_experts_per_tok") or 0,
        )

    @classmethod
    def named(cls, name_or_path: str) -> "ModelShape":
        """A model's shape from a local folder's config.json, a hub id's config.json in huggingface_hub's cache, or
        freetune's table of a few public shapes ('Qwen/Qwen2.5-Coder-1.5B-Instruct'), without any download."""
        config, name = read_config(name_or_path)
        if config is not None:
            return cls.from_config(config, name=name)
        key = _shape_key(name_or_path)
        if key in KNOWN_SHAPES:
            return KNOWN_SHAPES[key]
        raise KeyError(f"no known shape for {name_or_path!r}; known: {sorted(KNOWN_SHAPES)} (or give a folder "
                       f"with a config.json, or ModelShape.from_config(AutoConfig.from_pretrained(...)))")


def read_config(name_or_path: str) -> tuple[dict | None, str]:
    """(config.json's values, the name the shape takes) where a config.json is at hand without a download: a local
    folder's, or a hub id's in huggingface_hub's cache; (None, name) where none is."""
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text()), path.name
    cached = _cached_config(name_or_path)
    if cached is not None:
        return json.loads(Path(cached).read_text()), name_or_path.rsplit("/", 1)[-1]
    return None, name_or_path


def _cached_config(model_id: str) -> str | None:
    """The path of a hub id's config.json in huggingface_hub's cache, or None (not a hub id, or not cached)."""
    if "/" not in model_id or Path(model_id).expanduser().exists():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model_id, "config.json")
    except Exception:  # noqa: BLE001 - a malformed id: no cached config
        return None
    return found if isinstance(found, str) else None


def shape_of(model_id: str) -> tuple["ModelShape | None", str]:
    """(the model's shape, where it came from) before any weights are downloaded: a local folder's config.json, else the
    Hub's config.json alone (huggingface_hub caches it; the weights come later, if the plan lets them). Where the Hub
    cannot be reached, the shape freetune keeps for a few hub ids (KNOWN_SHAPES, what offline tests plan with), else
    (None, why): the plan then decides without a memory check and says so."""
    path = Path(model_id).expanduser()
    if (path / "config.json").is_file():
        return ModelShape.from_config(json.loads((path / "config.json").read_text()), name=path.name), \
            f"{path / 'config.json'}"
    if path.exists() or "/" not in model_id:  # a folder without a config, or a name of KNOWN_SHAPES (tests, the CLI)
        known = KNOWN_SHAPES.get(_shape_key(model_id))
        return (known, "freetune's table of shapes") if known else (None, f"{model_id!r} has no config.json")
    cached = _cached_config(model_id)
    if cached is not None:
        return ModelShape.from_config(json.loads(Path(cached).read_text()), name=model_id.rsplit("/", 1)[-1]), \
            f"the Hub's config.json of {model_id}"
    try:
        from huggingface_hub import hf_hub_download

        config = hf_hub_download(model_id, "config.json")
    except Exception as exc:  # noqa: BLE001 - offline, a private repo without a token, a typo: the plan says which
        why = f"its config.json could not be read from the Hub ({type(exc).__name__}: {str(exc)[:160]})"
        known = KNOWN_SHAPES.get(_shape_key(model_id))
        if known:
            return known, f"freetune's table of shapes: {why}"
        return None, why
    return ModelShape.from_config(json.loads(Path(config).read_text()), name=model_id.rsplit("/", 1)[-1]), \
        f"the Hub's config.json of {model_id}"


def _normalised(config: dict) -> dict:
    """A config.json's values as transformers' config class for its model_type fills them in (its defaults, e.g.
    Gemma-3's tied embeddings, and what it derives, e.g. Gemma-3's layer_types from sliding_window_pattern); as they
    are where transformers does not know the model_type."""
    try:
        from transformers import AutoConfig

        return AutoConfig.for_model(**config).to_dict()
    except Exception:  # noqa: BLE001 - an architecture this transformers does not know: the file's own values
        return config


def _sliding_window(cfg: dict, layer_types: tuple) -> int | None:
    """The sliding window some layer uses, or None: Qwen2/3 carry a window in config.json but use it only with
    use_sliding_window; a layer_types list without "sliding_attention" has none."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return None
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _shape_key(name: str) -> str:
    """'Qwen/Qwen2.5-Coder-1.5B-Instruct' -> 'qwen2.5-coder-1.5b': instruct/chat variants share the base shape."""
    key = name.rsplit("/", 1)[-1].lower()
    return re.sub(r"-(instruct|chat|it|base)(-v[\d.]+)?$", "", key)


# Public config.json values of the hub models the recipes name (random-weight copies are built from these).
KNOWN_SHAPES = {
    "qwen2.5-1.5b": ModelShape("Qwen2.5-1.5B", hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2,
                               vocab=151936, tied_embeddings=True, attention_bias=True, model_type="qwen2"),
    "qwen3-8b": ModelShape("Qwen3-8B", hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8,
                           vocab=151936, tied_embeddings=False, head_dim=128, qk_norm=True, model_type="qwen3"),
    "tinyllama-1.1b": ModelShape("TinyLlama-1.1B", hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4,
                                 vocab=32000, tied_embeddings=False, model_type="llama"),
}
KNOWN_SHAPES["qwen2.5-coder-1.5b"] = replace(KNOWN_SHAPES["qwen2.5-1.5b"], name="Qwen2.5-Coder-1.5B")

