"""RunConfig: the parameters cell as one checked record, which is also the Kaggle job file (issue 48).

Cheap: no model, no training (a few seconds, most of it importing TRL for the last test)."""

import dataclasses

import pytest

from conftest import RECIPES
from freetune.errors import FreetuneError
from freetune.platform import Paths
from freetune.plan import Hardware, for_world, make_plan
from freetune.run_config import RunConfig
from test_inputs import recipe_namespace


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_s_parameters_cell_becomes_one_checked_record(recipe):
    namespace = recipe_namespace(recipe)
    run = RunConfig.from_cell(namespace, recipe=recipe, target="colab")
    assert run.parameters == {name: namespace[name] for name in namespace["__annotations__"]}
    assert run.lora_rank == namespace["lora_rank"] and run.recipe == recipe
    # A name this recipe's cell leaves out reads the library's default; a name no recipe has is an error.
    assert run.gpu_memory_cap_gib == namespace.get("gpu_memory_cap_gib", 0.0)
    with pytest.raises(AttributeError, match="'lora_r' is not a parameter of this run; the parameters are: model_id"):
        run.lora_r


def test_a_bad_value_or_unknown_task_stops_the_record_with_what_to_change():
    with pytest.raises(FreetuneError, match=r"task = 'svgs': must be '' \(text checks only\) or one of "
                                            r"'home_assistant', 'svg'"):
        RunConfig.from_cell(recipe_namespace("svg_coder", task="svgs"))
    with pytest.raises(FreetuneError, match=r"lora_r: not a parameter of this notebook \(did you mean lora_rank\?\)"):
        RunConfig.from_cell(recipe_namespace("svg_coder", lora_r=8))


def test_the_plan_is_asked_with_the_cell_s_values_and_zero_means_let_the_plan_choose():
    run = RunConfig.from_cell(recipe_namespace("tiny_4gb", micro_batch=0, gpu_memory_cap_gib=4.0))
    asked = run.plan_request()
    assert asked["micro_batch"] is None and asked["memory_budget_gib"] == 4.0
    assert asked["model_shape"] == "TinyLlama/TinyLlama-1.1B-Chat-v1.0" and asked["lora_rank"] == 8
    assert "compile" not in asked  # tiny_4gb has no torch_compile parameter: make_plan's own default holds
    svg = RunConfig.from_cell(recipe_namespace("svg_coder", micro_batch=4))
    assert svg.plan_request()["micro_batch"] == 4 and svg.plan_request()["compile"] == "auto"
    assert "memory_budget_gib" not in svg.plan_request()


def test_the_job_file_gives_the_ranks_the_notebook_s_run_sized_for_their_job(tmp_path, monkeypatch):
    plan = make_plan(Hardware(ram_total_gib=16.0, ram_available_gib=12.0), micro_batch=2, grad_accum=4)
    run = RunConfig(parameters=RunConfig.from_cell(recipe_namespace("svg_coder")).parameters, recipe="svg_coder",
                    target="kaggle", paths=Paths.under(tmp_path / "run"), plan=plan)
    job = run.save(tmp_path / "train_ddp.json")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loaded = RunConfig.load(job)
    assert loaded.parameters == run.parameters and loaded.paths == run.paths
    assert (loaded.recipe, loaded.target) == ("svg_coder", "kaggle")
    # The ranks get the notebook's plan re-decided for the job's size (for_world), and nothing else changed.
    assert loaded.plan.replace(memory=plan.memory.estimate) == for_world(plan, 2)
    assert loaded.plan.layout.sampler != plan.layout.sampler  # on 2 ranks the rows are dealt by length (rank_balanced)


def test_train_reads_the_plan_from_its_config_and_refuses_another(tmp_path):
    from freetune.sft_config import make_config
    from freetune.train import train

    paths = Paths.under(tmp_path / "run").make()
    plan = make_plan(Hardware(ram_total_gib=16.0, ram_available_gib=12.0), micro_batch=2, grad_accum=1)
    config = make_config(paths, plan, max_steps=2, learning_rate=1e-4)
    assert config.freetune_plan is plan
    other = plan.replace(micro_batch=4)
    with pytest.raises(FreetuneError, match="a plan other than the one its config was made from"):
        train(None, None, [], config, paths=paths, plan=other)


def test_the_system_prompt_goes_one_way_whatever_the_rows_hold():
    """Every recipe gives its system prompt through data.as_chat: plain prompt/completion rows become chats that
    start with it, conversations without a system turn get it, and rows that carry their own keep theirs."""
    import datasets

    from freetune import data

    plain = datasets.Dataset.from_list([{"prompt": "Draw a cat", "completion": "<svg/>"}])
    chats = datasets.Dataset.from_list([
        {"messages": [{"role": "user", "content": "lights off"}, {"role": "assistant", "content": "{}"}]},
        {"messages": [{"role": "system", "content": "devices: lamp"}, {"role": "user", "content": "on"},
                      {"role": "assistant", "content": "{}"}]}])
    assert data.as_chat(plain, "Be brief.")[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    firsts = [row["messages"][0]["content"] for row in data.as_chat(chats, "Be brief.")]
    assert firsts == ["Be brief.", "devices: lamp"]
    assert data.as_chat(chats, "")[0]["messages"][0]["role"] == "user"  # no system prompt: the rows as they are
