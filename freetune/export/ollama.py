"""Run the GGUF with Ollama: a Modelfile whose TEMPLATE is the Go-template twin of the model's chat template when
that is one freetune trains with (freetune.templates: ChatML, Llama 3, Zephyr; checked on a probe conversation
before it is written), with its stop tokens and sampling defaults; and the commands that import it."""

from __future__ import annotations

import re
from pathlib import Path

from freetune.chat import SAMPLING
from freetune.errors import FreetuneError
from freetune.templates import Template
from freetune.templates import identify as identify_template


_END_MARKER = re.compile(r"end|eos|eot|^</s>$", re.I)


def stop_tokens(tokenizer, template: Template | None) -> list[str]:
    """Strings that end a turn: the template's end token (<|im_end|> for ChatML), the EOS token, and a pad token that
    marks an end such as Qwen's <|endoftext|> (a model that drifts past its turn emits it; a plain <pad> or <unk> is
    no stop)."""
    stops = [template.end_token(tokenizer)] if template is not None else []
    eos, pad = tokenizer.eos_token, tokenizer.pad_token
    for token in (eos, pad if pad and _END_MARKER.search(pad) else None):
        if token and token not in stops:
            stops.append(token)
    return stops


def _quote(text: str) -> str:
    if '"""' in text:
        raise FreetuneError('A Modelfile value cannot contain """ (it ends the quoted block); remove it from the '
                            'system prompt.')
    return f'"""{text}"""'


def write_modelfile(gguf_path: str | Path, tokenizer, out_path: str | Path | None = None, *,
                    system_prompt: str | None = None, temperature: float = SAMPLING["temperature"],
                    top_p: float = SAMPLING["top_p"], repeat_penalty: float = SAMPLING["repetition_penalty"],
                    num_ctx: int = 4096,
                    extra_parameters: dict | None = None) -> Path:
    """Write an Ollama Modelfile for gguf_path (default: 'Modelfile' next to it); returns its path.

    TEMPLATE is the Go-template twin of the tokenizer's chat template when that is one of freetune.templates'
    (ChatML, Llama 3, Zephyr: checked on a probe conversation). Any other template is left out: Ollama then reads
    the chat template the converter stored in the GGUF and picks its own matching template; check it with
    `ollama show NAME --template`.
    Beside a q8_0 file with its f16 twin, `Modelfile.f16` (FROM the f16 file) is written too: `ollama create -q
    q4_K_M` quantises an f16 GGUF, and ollama_commands names it.
    system_prompt: the default system message (None keeps the chat template's own default, if it has one).
    Defaults: temperature 0.7 and top_p 0.8 (Qwen's recommended sampling), num_ctx 4096 (Ollama's default
    context is shorter and silently cuts long prompts and answers).
    """
    gguf = Path(gguf_path).expanduser()
    if gguf.suffix != ".gguf":
        raise FreetuneError(f"{str(gguf)!r} is not a .gguf file: pass one of the files convert_to_gguf returned.")
    out = Path(out_path).expanduser() if out_path else gguf.parent / "Modelfile"
    # Ollama resolves FROM relative to the Modelfile's folder: keep the pair movable when they sit together.
    source = f"./{gguf.name}" if gguf.parent.resolve() == out.parent.resolve() else str(gguf.resolve())
    template, default_system, reason = identify_template(tokenizer)
    lines = [f"# Written by freetune.export.write_modelfile. Chat template: {reason}.", f"FROM {source}", ""]
    if template is not None:
        lines += [f"TEMPLATE {_quote(template.go(tokenizer))}", ""]
    else:
        lines += [f"# No TEMPLATE: {reason}; Ollama uses the chat template stored in the GGUF.", ""]
    system = system_prompt if system_prompt is not None else default_system
    if system:
        lines += [f"SYSTEM {_quote(system)}", ""]
    lines += [f'PARAMETER stop "{token}"' for token in stop_tokens(tokenizer, template)]
    params = {"temperature": temperature, "top_p": top_p, "repeat_penalty": repeat_penalty, "num_ctx": num_ctx,
              **(extra_parameters or {})}
    lines += [f"PARAMETER {key} {value}" for key, value in params.items()]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    f16 = _f16_beside(gguf)
    if f16 is not None and out_path is None:  # for `ollama create -q q4_K_M`, which quantises an f16 GGUF
        out.with_name(F16_MODELFILE).write_text(
            "\n".join(f"FROM ./{f16.name}" if line.startswith("FROM ") else line for line in lines) + "\n")
    return out


F16_MODELFILE = "Modelfile.f16"


def _f16_beside(gguf: Path) -> Path | None:
    """The f16 GGUF converted with `gguf` (same name, -F16), when there is one and `gguf` is not already a k-quant
    or f16 itself."""
    stem, _, kind = gguf.stem.rpartition("-")
    f16 = gguf.with_name(f"{stem}-F16.gguf")
    return f16 if kind.upper() not in ("F16", "Q4_K_M") and f16.is_file() else None


_OLLAMA_NAME = re.compile(r"^([a-z0-9][a-z0-9._-]*/)?[a-z0-9][a-z0-9._-]*(:[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def ollama_commands(modelfile: str | Path, name: str) -> str:
    """The shell commands that import the GGUF into Ollama and chat with it."""
    if not _OLLAMA_NAME.match(name):
        raise FreetuneError(f"{name!r} is not a valid Ollama model name: use lowercase letters, digits, '-', '_' "
                            f"and '.', optionally 'namespace/' before and ':tag' after (e.g. 'svg-coder:q8').")
    modelfile = Path(modelfile).expanduser().absolute()
    commands = f"ollama create {name} -f {modelfile}\nollama run {name}"
    f16 = modelfile.with_name(F16_MODELFILE)
    if f16.is_file():
        base = name.split(":")[0]
        commands += (f"\n# q4_k_m, the size Ollama users pull (~40% smaller than q8_0), quantised by Ollama from "
                     f"the f16 GGUF:\nollama create {base}:q4_k_m -q q4_K_M -f {f16}")
    return commands
