# ---
# jupyter:
#   freetune:
#     # What this recipe declares besides its cells, read by build_notebooks.py (the README's row),
#     # scripts/run_recipe.py and the tests (--embedded: the tiny model's architecture, the bundled rows;
#     # --real-model: the rows SmolLM2 trains on).
#     readme:
#       row: 2
#       model: "Qwen3-8B (4-bit)"
#       gpu: "2 x T4 (DDP)"
#       vram: "~6.5 GB per T4"
#       time: "~19 s/step published on T4 x2; 200 steps ~65 min"
#     embedded: {architecture: qwen3, sample: home_assistant}
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Home Assistant: Qwen3-8B turns requests into JSON actions
#
# **What it trains:** a LoRA adapter on Qwen3-8B in 4-bit so that "turn off the kitchen light" becomes
# `{"domain": "light", "service": "turn_off", "target": {"entity_id": "light.kitchen_light"}, "data": {}}`,
# naming only devices the home actually has. Data: a Home Assistant requests -> JSON action set as chat
# `messages` (tuxevil/Home-Assistant-Requests-V3 by default, 3,561 training examples).

# %% [markdown] tags=["colab"]
# **GPU:** Colab's T4: one 4-bit copy of the model, about 6 GB; each step trains on 8 rows (1 row x 8
# accumulation steps). The Kaggle notebook of this recipe trains on two T4s at once, 16 rows a step.

# %% [markdown] tags=["kaggle"]
# **GPU:** Kaggle "GPU T4 x2": the training cells run as `train_ddp.py` under `torchrun`, one full 4-bit copy
# of the model per GPU (DDP), global batch 16 = 2 GPUs x 1 row x 8 accumulation steps. About 6 GB per T4.
#
# **Why DDP and not `device_map="auto"`:** splitting the layers across two GPUs makes them take turns (GPU 1
# waits while GPU 0 computes its half, then the other way round), so it is no faster than one GPU; it only
# helps a model that does not fit one card. DDP gives each GPU its own copy and its own rows; they only
# exchange the small LoRA gradients, so two GPUs do about twice the work.

# %% tags=["parameters"]
# Model and data
model_id: str = "Qwen/Qwen3-8B"  # hub id or local folder; a pre-quantised 4-bit copy loads faster
dataset: str = "tuxevil/Home-Assistant-Requests-V3"  # hub id or local file with chat `messages`
dataset_split: str = "train"  # which split of the hub data set to read
columns: dict = {}  # your columns -> ours, e.g. {"messages": "conversation"}
# freetune.tasks: the row checks of the data audit and the metrics of the evaluation
task: str = "home_assistant"  # audit and evaluation checks: "svg", "home_assistant" or "" (text)
# the rows carry the home's devices in their own system turn already
system_prompt: str = ""  # prepended to rows without a system turn
chat_template: str = "auto"  # "auto": the model's own; else "chatml", "llama3" or "zephyr"
auto_clean: bool = True  # drop the rows the audit flags (invalid JSON, unknown entities, repeats)
accept_data_problems: bool = False  # True: train even if blocking problems remain (you have looked)

# LoRA
lora_rank: int = 16  # adapter capacity (r16 on all linear layers of Qwen3-8B: 43.6 M weights)
lora_alpha: int = 32  # adapter scale; 2 x rank is the usual choice
lora_dropout: float = 0.05  # regularises small data sets; 0 for large ones
lora_targets: str = "all-linear"  # layers to adapt; all linear layers learn best per parameter

# Training
max_steps: int = 200  # optimizer steps, each of micro_batch x grad_accum x GPUs rows (16 on T4 x2)
micro_batch: int = 1  # rows per GPU per forward; 8B on a T4 leaves room for 1 at 1,024 (0: auto)
grad_accum: int = 8  # micro-batches summed per step: a larger batch without more memory
learning_rate: float = 1e-4  # lower than for small models: an 8B model moves further per step
max_length: int = 1024  # tokens per row; the device list makes prompts long (see the audit)
# fused AdamW is faster, 8-bit paged AdamW keeps a quarter of the optimizer state
optimizer: str = "auto"  # "auto": fused AdamW when its state fits easily, else "paged_adamw_8bit"
max_grad_norm: float = 1.0  # gradient clipping; lower (0.3) steadies small batches
# recomputes activations in the backward: slower steps, far less memory
gradient_checkpointing: str = "auto"  # "auto": on if the batch needs it (~30% slower); "on", "off"
precision: str = "auto"  # "auto" picks from the GPU; "fp16" forces the T4 policy, "bf16" Ampere's
# compiling takes a minute or two at the start; "off" runs eagerly
torch_compile: str = "auto"  # compile decoder layers (faster, less memory); "auto": on for a GPU
logging_steps: int = 5  # print progress (loss, tokens/s, memory, ETA) every N steps
report_to: str = "none"  # also log to "tensorboard" or "trackio" (files in the run folder)
ddp_processes: int = 0  # torchrun processes to start; 0: one per visible GPU (2 on T4 x2)
seed: int = 0  # data order, held-out rows and LoRA initialisation

# Checkpoints
save_steps: int = 25  # checkpoint every N steps, so a stopped session resumes, not restarts
# Colab's and Kaggle's sessions end after 12 h; locally 0 means no budget
time_budget_min: float = 0  # stop and save after N minutes; 0: 1 h before the 12 h session limit
hub_checkpoint_repo: str = ""  # private Hub repo for checkpoints (resume anywhere); needs HF_TOKEN
output_dir: str = ""  # empty: the platform's default (Kaggle /kaggle/working, Colab /content)
run_name: str = "home-assistant"  # this run's folder; reuse it to resume, change it to start anew
use_drive: bool = False  # Colab: keep the run folder on Google Drive so it outlives the session

# Evaluation
eval_rows: int = 16  # rows held out (never trained on) for the base-vs-adapter check at the end
eval_steps: int = 25  # held-out (eval) loss every N steps, in the progress and the plot; 0: never
sanity_rows: int = 8  # requests generated from, base vs adapter, in the evaluation
max_new_tokens: int = 128  # generation length in the evaluation; one JSON action is short

# Export
export_gguf: bool = False  # merge into a 16-bit copy and convert to GGUF for llama.cpp / Ollama
hub_repo: str = ""  # private Hub repo to push the adapter to, e.g. "you/home-assistant"; HF_TOKEN

# %% tags=["install"]
# Replaced in each notebook by build_notebooks.py with that platform's pinned install.
# Locally: pip install -e ".[train,tasks]"

# %% [markdown]
# ## Preflight
# Reads the machine before anything is loaded: GPU, compute capability, memory, disk. It refuses a GPU the
# installed PyTorch cannot run (Kaggle's P100) and picks the precision: fp16 on a T4 (no fast bf16 there),
# bf16 on Ampere and newer, fp32 on a CPU, each with its reason.
#
# Your parameters become one record, `run`, and every later cell reads its settings from it (`run.lora_rank`,
# `run.plan`, `run.paths`): to change a setting, change the parameters cell and run everything again.

# %% tags=["run"]
import freetune

# The parameters above in one record, `run`, that every later cell reads: each value is checked first (a typo or an
# out-of-range value stops here, before anything loads). build_notebooks.py fills in recipe and target.
run = freetune.RunConfig.from_cell(globals(), recipe=None, target=None)
run = run.preflight()  # the plan for this machine; a Hub repo's token is checked now, not after hours of training
run = run.with_paths()  # the run's folders: reuse run_name to resume, change it to start fresh
run.plan

# %% [markdown]
# ## Data audit
# Before any GPU time: load the rows, check them, clean them. Every answer must be one JSON action that
# matches the schema (domain, service, target.entity_id, data) and names only devices listed in that row's
# system turn: a model trained on actions for devices the home does not have learns to invent devices.

# %%
tokenizer = freetune.model.load_tokenizer(run.model_id, chat_template=run.chat_template)
rows = freetune.data.normalize(freetune.data.load_rows(run.dataset, split=run.dataset_split), columns=run.columns)
rows = freetune.data.as_chat(rows, run.system_prompt)  # an instruct model learns best in its own chat format
print(freetune.model.check_chat_template(tokenizer, rows))
# Audited and cleaned before the split: the held-out rows pass the same checks, and with duplicates and
# conflicting answers gone no prompt can be on both sides.
rows, audit_report, cleaning = freetune.audit.audit_and_clean(
    rows, tokenizer=tokenizer, max_length=run.plan.batch.max_length, checks=freetune.tasks.audit_checks(run.task),
    source=run.dataset, auto_clean=run.auto_clean, accept_problems=run.accept_data_problems,
)
train_rows, held_out = freetune.data.split_eval(rows, run.eval_rows, seed=run.seed)
run = run.replan(longest_row=audit_report.longest_row)  # sized for these rows
print(f"Plan for these rows: {run.plan.one_line()}")
# before the model loads: a resume is of the same run (same settings, model and rows), and the disk has room
freetune.checkpoint.check_run(run.paths, run.parameters, run.plan, train_rows)
freetune.data.save_prepared(run.paths.data, train_rows, held_out)

# %% [markdown]
# Why a few identical rows matter: the loss is computed only on the answers, so a short answer repeated in
# many rows is the cheapest thing for the model to learn. Its loss goes to zero first, and the model learns that
# this answer is always likely, for any prompt.

# %% [markdown]
# ## Model
# The base model is loaded in 4-bit NF4 (about 0.5 byte per weight), frozen, and a small LoRA adapter is
# trained on top. Its non-quantised weights load in the plan's dtype, not the checkpoint's: a T4 must not
# get bfloat16 weights.

# %% tags=["train"]
dist = freetune.distributed.init()
train_rows, held_out = freetune.data.load_prepared(run.paths.data)
tokenizer = freetune.model.load_tokenizer(run.model_id, chat_template=run.chat_template)
model = freetune.model.load_base_model(run.model_id, run.plan, local_rank=dist.local_rank,
                                       memory_cap_gib=run.gpu_memory_cap_gib)
model, trainable, total = freetune.model.attach_lora(model, rank=run.lora_rank, alpha=run.lora_alpha,
                                                     dropout=run.lora_dropout, target_modules=run.lora_targets,
                                                     seed=run.seed)
freetune.distributed.print_layout(dist, run.plan.batch.micro_batch, run.plan.batch.grad_accum, trainable, total)

# %% [markdown]
# ## Train
# One line per log step: loss, learning rate, tokens/s, memory in use / peak, and the time left.
# Checkpoints land in the run folder every `save_steps`; running this again resumes from the newest one.

# %% tags=["train"]
config = run.sft_config(assistant_only="messages" in train_rows.column_names)  # the Trainer's settings, from the plan
summary = freetune.train.train(model, tokenizer, train_rows, config, paths=run.paths, eval_dataset=held_out,
                               time_budget_min=run.time_budget_min, hub_checkpoint_repo=run.hub_checkpoint_repo)
del model  # free the GPU for the evaluation below
freetune.distributed.cleanup()

# %%
summary = freetune.train.show_summary(run.paths)

# %% [markdown]
# ## Evaluate
# A falling loss proves little: this generates from held-out requests with the base model and with the
# adapter, checks each action (valid JSON, schema, only entities the home has), and says plainly if the
# adapter has collapsed into one answer for every request.

# %%
prompts = freetune.evaluate.pick_rows(held_out, run.sanity_rows)
comparison = freetune.evaluate.compare(run.model_id, run.paths.adapter, prompts, task=run.task or None,
                                     max_new_tokens=run.max_new_tokens)
comparison

# %% [markdown]
# ## Try it
# Type a prompt and watch the adapter answer as it writes (an empty prompt ends). Run headless
# (papermill, CI), nobody can type, so it answers a few held-out prompts instead.

# %% [markdown] tags=["kaggle"]
# This cell runs here in the notebook, on one GPU, after the torchrun job has ended.

# %%
answers = freetune.chat.try_it(run.model_id, run.paths.adapter, held_out,
                               system_prompt=run.system_prompt or None, max_new_tokens=run.max_new_tokens)

# %% [markdown]
# ## Export
# The adapter (a few MB to a few hundred) is always saved in the run folder. To run the model at home:
# `export_gguf=True` merges it into a 16-bit copy of the base model (on the GPU if it fits, else on the CPU;
# RAM and disk are checked first), converts that with llama.cpp's own converter (f16 and q8_0) and writes an
# Ollama Modelfile; Ollama makes q4_k_m, the size its users pull, from the f16 file (the command is
# printed). The converter comes from PyPI's llama-cpp-python source package, or
# `git clone --depth 1 https://github.com/ggml-org/llama.cpp`.
# `hub_repo` pushes the adapter, with a model card recording base model, data, recipe, parameters, audit and
# evaluation, to a private Hub repo (token from Colab/Kaggle secrets or HF_TOKEN, never printed).

# %%
from pathlib import Path

freetune.export.check_adapter(run.paths.adapter)
print(f"Adapter: {run.paths.adapter}")
if run.export_gguf:
    merged = freetune.export.merge(run.model_id, run.paths.adapter, f"{run.paths.run_dir}/merged")
    ggufs = freetune.export.convert_to_gguf(merged, f"{run.paths.run_dir}/gguf",
                                            converter=freetune.export.fetch_converter())
    modelfile = freetune.export.write_modelfile(ggufs[-1], tokenizer, system_prompt=run.system_prompt or None)
    print(freetune.export.ollama_commands(modelfile, run.run_name))
if run.hub_repo:
    card = freetune.export.model_card(
        base_model=run.model_id, dataset=run.dataset, recipe=f"recipes/{run.recipe}.py", parameters=run.parameters,
        audit_summary=audit_report.to_dict(), eval_table=comparison.to_dict(), repo_id=run.hub_repo)
    (Path(run.paths.adapter) / "README.md").write_text(card)
    freetune.export.push_to_hub(run.paths.adapter, run.hub_repo,
                                token=freetune.secrets.hf_token(required=True, purpose=f"push to {run.hub_repo}"))
