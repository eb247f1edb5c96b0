# ---
# jupyter:
#   freetune:
#     # What this recipe declares besides its cells, read by build_notebooks.py (the README's row),
#     # scripts/run_recipe.py and the tests (--embedded: the tiny model's architecture, the bundled rows;
#     # --real-model: the rows SmolLM2 trains on).
#     readme:
#       row: 3
#       model: "TinyLlama-1.1B-Chat-v1.0"
#       gpu: "any 4 GB card"
#       vram: "< 3.75 GiB peak"
#       time: "~25 min, 200 steps"
#     embedded: {architecture: llama, sample: alpaca}
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
# # Tiny 4 GB: fine-tune TinyLlama-1.1B-Chat on a 4 GB card
#
# **What it trains:** a LoRA adapter on TinyLlama/TinyLlama-1.1B-Chat-v1.0 in 4-bit, on instruction /
# input / output rows (yahma/alpaca-cleaned by default) mapped to prompt / completion. **GPU:** anything with
# 4 GB (a GTX 1650, an MX card, a T4 shared with something else): the plan turns on what a 4 GB card needs and
# fills the rest with rows. Rank 8, 8 rows per optimizer step packed into as few forward passes as fit (sized from
# the rows' real lengths), gradient checkpointing with the layers' inputs and the input embeddings in host RAM, and
# gradient clipping at 0.3 keep the peak under 3.75 GiB; GPU memory is printed at every log step so you see the
# headroom.

# %% [markdown] tags=["colab"]
# On Colab's T4 (16 GB) it runs as it is; `gpu_memory_cap_gib = 4.0` shows what a 4 GB card goes through.

# %% [markdown] tags=["kaggle"]
# On Kaggle's T4 x2 it trains on both GPUs at once (DDP), a copy of the model on each;
# `gpu_memory_cap_gib = 4.0` holds each GPU to what a 4 GB card has.

# %% tags=["parameters"]
# Model and data
model_id: str = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"  # hub id or local folder; 1.1B fits 4 GB
dataset: str = "yahma/alpaca-cleaned"  # hub id or local file
dataset_split: str = "train"  # which split of the hub data set to read
columns: dict = {}  # Alpaca's instruction/input/output are read as they are; map others
# freetune.tasks: the row checks of the data audit and the metrics of the evaluation
task: str = ""  # audit and evaluation checks: "svg", "home_assistant" or "" (text)
system_prompt: str = "You are a helpful assistant."  # shown to the model in every row
chat_template: str = "auto"  # "auto": the model's own; else "chatml", "llama3" or "zephyr"
auto_clean: bool = True  # drop the rows the audit flags (empty, junk repeats) before training
accept_data_problems: bool = False  # True: train even if blocking problems remain (you have looked)

# LoRA
lora_rank: int = 8  # small adapter: fewer trainable weights, less optimizer memory
lora_alpha: int = 16  # adapter scale; 2 x rank is the usual choice
# alpaca-cleaned is large: 200 steps see 3% of its 52k rows, each once, with nothing to overfit
lora_dropout: float = 0.0  # 0 for large data sets; 0.05 regularises small ones
lora_targets: str = "all-linear"  # layers to adapt; all linear layers learn best per parameter

# Training
max_steps: int = 200  # optimizer steps; each sees micro_batch x grad_accum rows
micro_batch: int = 0  # rows per forward pass; 0: preflight picks the most that fit 4 GB (fastest)
grad_accum: int = 8  # rows per step when micro_batch is 0; else micro-batches per step
learning_rate: float = 2e-4  # higher than for full fine-tuning; lower it if the loss spikes
max_length: int = 512  # tokens per row; memory grows with it (the audit counts the rows cut)
# fused AdamW is faster, 8-bit paged AdamW keeps a quarter of the optimizer state
optimizer: str = "auto"  # "auto": fused AdamW when its state fits easily, else "paged_adamw_8bit"
max_grad_norm: float = 0.3  # tight clipping: batch-1 gradients are noisy
# recomputes activations in the backward: slower steps, far less memory
gradient_checkpointing: str = "auto"  # "auto": on if the batch needs it (~30% slower); "on", "off"
precision: str = "auto"  # "auto" picks from the GPU; "fp16" forces the T4 policy, "bf16" Ampere's
gpu_memory_cap_gib: float = 0.0  # emulate a smaller card on a bigger one (e.g. 4.0); 0: no cap
logging_steps: int = 1  # print progress and GPU memory at every step: the point of this recipe
report_to: str = "none"  # also log to "tensorboard" or "trackio" (files in the run folder)
ddp_processes: int = 0  # torchrun processes to start; 0 means one per visible GPU
seed: int = 0  # data order, held-out rows and LoRA initialisation

# Checkpoints
save_steps: int = 50  # checkpoint every N steps, so a crash resumes instead of restarting
# Colab's and Kaggle's sessions end after 12 h; locally 0 means no budget
time_budget_min: float = 0  # stop and save after N minutes; 0: 1 h before the 12 h session limit
hub_checkpoint_repo: str = ""  # private Hub repo for checkpoints (resume anywhere); needs HF_TOKEN
output_dir: str = ""  # empty: the platform's default (Kaggle /kaggle/working, Colab /content)
run_name: str = "tiny-4gb"  # this run's folder; reuse it to resume, change it to start fresh
use_drive: bool = False  # Colab: keep the run folder on Google Drive so it outlives the session

# Evaluation
eval_rows: int = 16  # rows held out (never trained on) for the base-vs-adapter check at the end
eval_steps: int = 50  # held-out (eval) loss every N steps, in the progress and the plot; 0: never
sanity_rows: int = 6  # prompts generated from, base vs adapter, in the evaluation
max_new_tokens: int = 128  # generation length in the evaluation

# Export
export_gguf: bool = False  # merge into a 16-bit copy and convert to GGUF for llama.cpp / Ollama
hub_repo: str = ""  # private Hub repo to push the adapter to, e.g. "you/tiny-4gb"; needs HF_TOKEN

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
# Before any GPU time: load the rows, check them, clean them: empty answers, one answer repeated in many rows
# (a pipeline's error string, say), duplicates, and rows `max_length` would cut.

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

# %% [markdown] tags=["kaggle"]
# On several GPUs each process loads a full copy on its own GPU (DDP): splitting the layers across GPUs
# (`device_map="auto"`) would run them one after another, no faster than one GPU.

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
# A falling loss proves little: this generates from held-out prompts with the base model and with the
# adapter, and says plainly if the adapter has collapsed into one answer for every prompt.

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
