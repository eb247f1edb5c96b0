"""The chat templates freetune trains with by name, for base models that have none, and their Ollama twins.

A base model's tokenizer often has no chat template, and an instruct model's may not mark its assistant turns.
The recipes' `chat_template` parameter is "auto" (the model's own) or one of TEMPLATES:
- "chatml":  <|im_start|>role ... <|im_end|>: Qwen's format and many others' (the tokenizer must have both tokens);
- "llama3":  <|start_header_id|>role<|end_header_id|> ... <|eot_id|>: Llama 3's (its base models have the tokens);
- "zephyr":  <|role|> ... EOS: TinyLlama-Chat's and Zephyr's; plain text markers, so any tokenizer with an EOS.
Each is built from the same few pieces three ways, so the three cannot drift apart:
- `jinja`: the Hugging Face chat template training uses, every assistant answer inside {% generation %} markers, so
  TRL's assistant_only_loss puts the loss on every assistant turn of a conversation (and on nothing else);
- `go`: the Ollama Modelfile TEMPLATE (Go's text/template), which export writes next to the GGUF;
- `render`: the same rules in Python, to check on a probe conversation which template a tokenizer's own one is.
A named template needs tokens the vocabulary already has: added tokens would start with untrained embeddings that
LoRA (on the linear layers) never trains, so the model could not learn to end its turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from freetune.errors import FreetuneError


@dataclass(frozen=True)
class Template:
    name: str
    header_start: str      # a turn starts with header_start + role + header_end
    header_end: str
    end: str | None        # the token that ends every turn (None: the tokenizer's EOS)
    sep: str               # text after the end token
    bos: bool              # the template starts with the tokenizer's BOS (llama.cpp adds it itself: not in `go`)
    needs: tuple[str, ...]  # special tokens the vocabulary must already hold
    family: str            # who uses it, for messages

    def end_token(self, tokenizer) -> str:
        return self.end if self.end is not None else tokenizer.eos_token

    def jinja(self) -> str:
        end = f"'{self.end}'" if self.end is not None else "eos_token"
        quote = _jinja_str
        return (("{{- bos_token }}" if self.bos else "")
                + "{%- for message in messages %}"
                f"{{{{- {quote(self.header_start)} + message['role'] + {quote(self.header_end)} }}}}"
                "{%- if message['role'] == 'assistant' %}"
                f"{{%- generation %}}{{{{- message['content'] + {end} }}}}{{%- endgeneration %}}"
                f"{{{{- {quote(self.sep)} }}}}"
                f"{{%- else %}}{{{{- message['content'] + {end} + {quote(self.sep)} }}}}{{%- endif %}}"
                "{%- endfor %}"
                f"{{%- if add_generation_prompt %}}{{{{- {quote(self.header('assistant'))} }}}}{{%- endif %}}")

    def header(self, role: str) -> str:
        return f"{self.header_start}{role}{self.header_end}"

    def go(self, tokenizer) -> str:
        """The Ollama TEMPLATE: .System first (Ollama gathers the system messages there, or puts the Modelfile's
        SYSTEM), then the turns; a last assistant turn is left open (Ollama continues it), and a conversation ending
        on a user turn gets the assistant header. Text that must survive sits right before a tag without a '-'."""
        end = self.end_token(tokenizer) + self.sep
        return ("{{- if .System }}" + self.header("system") + "{{ .System }}" + end + "{{ end }}\n"
                "{{- range $i, $_ := .Messages }}\n"
                "{{- $last := eq (len (slice $.Messages $i)) 1 }}\n"
                '{{- if eq .Role "user" }}' + self.header("user") + "{{ .Content }}" + end
                + '{{ else if eq .Role "assistant" }}' + self.header("assistant") + "{{ .Content }}"
                "{{ if not $last }}" + end + "{{ end }}\n"
                "{{- end }}\n"
                '{{- if and (ne .Role "assistant") $last }}' + self.header("assistant") + "{{ end }}\n"
                "{{- end }}")

    def render(self, tokenizer, messages: list[dict], system: str | None) -> str:
        """What `go` renders for a conversation that ends on a user turn (system: .System)."""
        end = self.end_token(tokenizer) + self.sep
        text = f"{self.header('system')}{system}{end}" if system else ""
        for m in messages:
            if m["role"] in ("user", "assistant"):
                text += f"{self.header(m['role'])}{m['content']}{end}"
        return text + self.header("assistant")


def _jinja_str(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


TEMPLATES = {t.name: t for t in (
    Template("chatml", "<|im_start|>", "\n", "<|im_end|>", "\n", False, ("<|im_start|>", "<|im_end|>"),
             "Qwen's format, and many others'"),
    Template("llama3", "<|start_header_id|>", "<|end_header_id|>\n\n", "<|eot_id|>", "", True,
             ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "Llama 3's"),
    Template("zephyr", "<|", "|>\n", None, "\n", False, (), "TinyLlama-Chat's and Zephyr's: any tokenizer with an EOS"),
)}
CHOICES = ("auto", *TEMPLATES)


def _has_token(tokenizer, token: str) -> bool:
    return token in tokenizer.get_vocab()


def usable(tokenizer) -> list[str]:
    """The named templates this tokenizer has the tokens for."""
    return [name for name, t in TEMPLATES.items()
            if all(_has_token(tokenizer, tok) for tok in t.needs) and t.end_token(tokenizer)]


def _named() -> str:
    return (f"{', '.join(repr(n) for n in TEMPLATES)} "
            f"({'; '.join(f'{n}: {t.family}' for n, t in TEMPLATES.items())})")


def describe_choices(tokenizer) -> str:
    """What to set, and which of the named templates this tokenizer's vocabulary allows."""
    fits = usable(tokenizer)
    return (f"Set `chat_template` to one of {_named()}; this tokenizer has the tokens for "
            f"{', '.join(repr(n) for n in fits) if fits else 'none of them'}.")


def apply(tokenizer, name: str, model_id: str = "the model"):
    """Give the tokenizer the named template (in place; returns it). "auto" keeps the model's own, which may be none:
    freetune.model.check_chat_template says so once it knows the data is chat-shaped."""
    if name == "auto":
        return tokenizer
    template = TEMPLATES.get(name)
    if template is None:
        raise FreetuneError(f"chat_template={name!r} is not one freetune knows. Use 'auto' (the model's own) or one "
                            f"of {_named()}.")
    missing = [t for t in template.needs if not _has_token(tokenizer, t)]
    if missing or not template.end_token(tokenizer):
        lacks = ", ".join(missing) if missing else "an EOS token"
        raise FreetuneError(
            f"chat_template={name!r} needs {lacks}, which the tokenizer of {model_id} does not have (a new token's "
            f"embedding would start untrained, and LoRA does not train embeddings). {describe_choices(tokenizer)}")
    tokenizer.chat_template = template.jinja()
    end = template.end_token(tokenizer)
    if tokenizer.pad_token is None and tokenizer.eos_token and tokenizer.eos_token != end:
        tokenizer.pad_token = tokenizer.eos_token  # the old EOS pads: a pad equal to the turn's end would hide it
    # The model must learn to end its turn with the template's end token, and generation must stop there.
    tokenizer.eos_token = end
    return tokenizer


_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
          {"role": "user", "content": "Draw a red circle."}]
_PROBE_SYSTEM = "You draw SVG."


def identify(tokenizer) -> tuple[Template | None, str | None, str]:
    """(template, its default system prompt or None, why): the named template whose Ollama twin renders exactly as
    the tokenizer's chat template on a probe conversation (with and without a system message), else (None, None,
    why not). A default system prompt the template inserts (Qwen2.5: "You are Qwen, ...") is returned."""
    own = getattr(tokenizer, "chat_template", None)
    if not own:
        return None, None, "the tokenizer has no chat template"
    try:
        with_system = tokenizer.apply_chat_template([{"role": "system", "content": _PROBE_SYSTEM}, *_PROBE],
                                                    tokenize=False, add_generation_prompt=True)
        without = tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # a template that raises on plain turns cannot be translated either
        return None, None, f"the chat template failed on a probe conversation ({exc})"
    for template in TEMPLATES.values():
        bos = (tokenizer.bos_token or "") if template.bos else ""
        if with_system != bos + template.render(tokenizer, _PROBE, _PROBE_SYSTEM):
            continue
        if without == bos + template.render(tokenizer, _PROBE, None):
            return template, None, f"{template.name} template, checked on a probe conversation"
        system_turn = bos + template.header("system")
        rest = template.render(tokenizer, _PROBE, None)
        end = template.end_token(tokenizer) + template.sep
        if without.startswith(system_turn) and without.endswith(end + rest):
            default = without[len(system_turn):len(without) - len(end + rest)]
            if end not in default:
                return template, default, f"{template.name} template, checked on a probe conversation"
        return None, None, f"the chat template renders a conversation without a system message unlike {template.name}"
    return None, None, (f"the chat template is none of {', '.join(TEMPLATES)} (it adds or changes text, e.g. "
                        f"reasoning markers)")


def training_template(tokenizer) -> str | None:
    """The template TRL's SFTTrainer trains assistant-only loss with: the tokenizer's own when it marks the assistant
    turns ({% generation %}), else TRL's patched twin of a template it knows; None when TRL is not installed.

    TRL refuses any other template only once the trainer is built, after the model has loaded: this asks TRL's own
    check (trl 1.16 `get_training_chat_template`, tokenizer only) first, and names the `chat_template` to set."""
    try:
        from trl.chat_template_utils import get_training_chat_template, has_generation_markers
    except ImportError:
        return None
    if has_generation_markers(tokenizer.chat_template):
        return tokenizer.chat_template
    try:
        return get_training_chat_template(tokenizer) or tokenizer.chat_template
    except ValueError as exc:
        raise FreetuneError(f"This model's chat template cannot mark assistant turns, so the loss cannot be limited to "
                            f"the answers, and TRL cannot patch it (TRL: {exc}); training would fail after the model "
                            f"loads. {suggest(tokenizer)} Or map the data to `prompt`/`completion` columns (the "
                            f"`columns` parameter).") from exc


def suggest(tokenizer) -> str:
    """The `chat_template` value to set instead of the model's own: the named template it renders like, else the
    choices its vocabulary allows."""
    template, default_system, _ = identify(tokenizer)
    if template is None:
        return describe_choices(tokenizer)
    dropped = (f" (its default system prompt {default_system!r} is not added; `system_prompt` gives one)"
               if default_system else "")
    return (f"It renders conversations as {template.name} does (checked on a probe conversation): set "
            f"`chat_template=\"{template.name}\"`{dropped}.")

