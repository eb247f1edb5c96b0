#!/usr/bin/env bash
# Issue 44 on the GPU machine: the recipes' Colab notebooks through papermill on the real SmolLM2-135M-Instruct,
# each run then judged greedy at every checkpoint (scripts/real_model_gpu.py judge). Run from the repository root
# with .whl/ carried and the GGUF's parts in $PARTS (in order):
#   bash scripts/real_model_gpu.sh start     # convert, write the data, start every run detached (setsid)
#   bash scripts/real_model_gpu.sh finish N  # wait up to N s for them; pack what is done into $OUT
# The runs outlive one device call (at most 10 minutes): `finish` in the next call picks them up.
# T4 emulation: precision fp16 everywhere and, through an IPython startup file, every notebook kernel capped
# at 14.5 GiB of the GPU (torch.cuda.set_per_process_memory_fraction); tiny_4gb caps itself at 4 GiB.
# torch_compile is off (where the recipe has it): a 135M model is launch-bound, compiling costs more than it saves
# here, and the runs measure what the adapter learns, not speed.
set -u
W=/tmp/ft44
STEPS_SVG=${STEPS_SVG:-300}
STEPS_SMALL=${STEPS_SMALL:-150}
EVAL_ROWS=${EVAL_ROWS:-24}
SANITY_ROWS=${SANITY_ROWS:-8}
SVG_TOKENS=${SVG_TOKENS:-320}
PY=${PY:-python3}

job() {  # name recipe task judge_tokens -p ... : the notebook, then the greedy judge of its checkpoints
    local name=$1 recipe=$2 task=$3 tokens=$4; shift 4
    (
        $PY scripts/run_recipe.py "$recipe" --target colab --out "$W/nb/$name" -p model_id "$W/smol" \
            -p output_dir "$W/runs" -p run_name "$name" -p precision fp16 -p eval_rows "$EVAL_ROWS" \
            -p sanity_rows "$SANITY_ROWS" -p eval_steps 50 "$@"
        echo "notebook rc=$?"
        $PY scripts/real_model_gpu.py judge "$W/runs/$name" --base "$W/smol" --max-new-tokens "$tokens" \
            ${task:+--task "$task"} --out "$W/judge/$name.json"
        echo "judge rc=$?"
    ) >"$W/logs/$name.log" 2>&1
    touch "$W/done/$name"
}

start() {
    source scripts/device_setup.sh || exit 1
    mkdir -p "$W"/{nb,runs,judge,logs,done,data} /tmp/ipy/profile_default/startup
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY scripts/smollm2_from_gguf.py $PARTS --out "$W/smol" 2>&1 | grep -v "it/s\]" | tail -3 || exit 1
    $PY scripts/real_model_gpu.py data "$W/data" || exit 1
    cat >/tmp/ipy/profile_default/startup/00-t4-cap.py <<'PYEOF'
import torch
_total = torch.cuda.get_device_properties(0).total_memory / 2**30
torch.cuda.set_per_process_memory_fraction(14.5 / _total, 0)
print(f"T4 emulation: GPU memory capped at 14.5 of {_total:.1f} GiB", flush=True)
PYEOF
    export IPYTHONDIR=/tmp/ipy
    setsid bash scripts/real_model_gpu.sh runall </dev/null >"$W/logs/all.log" 2>&1 &
    echo "started 6 runs at $(date -u +%T)"
}

runall() {  # the six runs side by side: each is launch-bound on its own CPU core, the GPU has room for all
    # The Trainer keeps the last 3 checkpoints: save every third of the run, so all three points of the curve stay.
    local svg=(-p torch_compile off -p max_steps "$STEPS_SVG" -p save_steps $((STEPS_SVG / 3)) -p max_new_tokens
               "$SVG_TOKENS" -p chat_template chatml)
    local small=(-p chat_template chatml -p max_steps "$STEPS_SMALL" -p save_steps $((STEPS_SMALL / 3)))
    local sample=$PWD/freetune/sample_data
    job svg svg_coder svg "$SVG_TOKENS" -p dataset "$W/data/svg_4750.jsonl" "${svg[@]}" &
    job svg_lr1e-3 svg_coder svg "$SVG_TOKENS" -p dataset "$W/data/svg_4750.jsonl" -p learning_rate 1e-3 "${svg[@]}" &
    job seed_no_audit svg_coder svg "$SVG_TOKENS" -p dataset "$W/data/svg_seed_story.jsonl" -p auto_clean False \
        -p accept_data_problems True "${svg[@]}" &
    job seed_audit svg_coder svg "$SVG_TOKENS" -p dataset "$W/data/svg_seed_story.jsonl" "${svg[@]}" &
    job home_assistant home_assistant home_assistant 128 -p dataset "$sample/home_assistant_sample.jsonl" \
        -p torch_compile off -p learning_rate 2e-4 "${small[@]}" &
    job tiny_4gb tiny_4gb "" 128 -p dataset "$sample/alpaca_sample.jsonl" -p gpu_memory_cap_gib 4.0 "${small[@]}" &
    wait
}

finish() {
    local deadline=$((SECONDS + ${1:-500}))
    while [ "$(ls "$W/done" | wc -l)" -lt 6 ] && [ $SECONDS -lt $deadline ]; do sleep 10; done
    echo "done: $(ls "$W/done" | tr '\n' ' ') at $(date -u +%T)"
    for log in "$W"/logs/*.log; do echo "== $log"; grep -E "rc=|adherence|Error|error:|Traceback" "$log" | tail -12; done
    nvidia-smi --query-gpu=memory.used --format=csv,noheader
    tar czf "$OUT/judge.tgz" -C "$W" judge logs 2>/dev/null
    tar czf "$OUT/notebooks.tgz" -C "$W" nb 2>/dev/null
    ls -la "$OUT"
    [ "$(ls "$W/done" | wc -l)" -ge 6 ]
}

"$@"
