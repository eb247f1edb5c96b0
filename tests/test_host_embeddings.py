"""freetune.speed.host_embeddings: the input embedding table looked up in host RAM gives the same logits and LoRA
gradients, and goes back where it was. On this CPU-only machine the table's "home" is the CPU too: the lookup, the
forward's replacement and its undoing are what runs here; the copy to a GPU runs in the GPU benchmark (scripts/bench.py,
4 GiB)."""

import pytest
import torch

from freetune.fixtures import cached_tiny_model
from freetune.model import attach_lora, load_base_model
from freetune.plan import Hardware, make_plan
from freetune.reach.torch import stashed
from freetune.speed import host_embeddings


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.fixture(scope="module")
def tiny_llama():
    """A 4-bit tiny Llama (untied head, as TinyLlama) with a LoRA adapter, loaded the way the recipes load it."""
    plan = make_plan(Hardware(ram_total_gib=16.0, ram_available_gib=12.0))
    model = load_base_model(str(cached_tiny_model("llama")), plan, gradient_checkpointing=True)
    model, _, _ = attach_lora(model, rank=4, alpha=8, dropout=0.0, seed=0)
    model.train()
    return model


def test_a_table_looked_up_on_the_host_gives_the_same_logits_loss_and_lora_gradients(tiny_llama):
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    embedding = tiny_llama.get_input_embeddings()
    logits, loss, grads = _loss_and_grads(tiny_llama, ids)

    host_embeddings.attach(embedding, torch.device("cpu"))
    try:
        assert embedding.forward.__func__ is host_embeddings._host_forward
        host_logits, host_loss, host_grads = _loss_and_grads(tiny_llama, ids)
    finally:
        host_embeddings.detach(embedding)
    assert torch.equal(host_logits, logits) and torch.equal(host_loss, loss)
    assert grads.keys() == host_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert torch.equal(host_grads[name], grad), name
    # Undone: the module's own forward, no attribute left behind.
    assert "forward" not in embedding.__dict__ and not hasattr(embedding, host_embeddings.HOME_ATTR)
    assert torch.equal(_loss_and_grads(tiny_llama, ids)[0], logits)


def test_only_an_untied_table_on_a_gpu_moves(tiny_llama, tiny_model_dir):
    # On this machine the table is on the CPU already: nothing moves, nothing to undo.
    assert host_embeddings.to_host(tiny_llama) == 0 and host_embeddings.to_gpu(tiny_llama) is False
    # A head that shares the table (Qwen2's tie_word_embeddings) keeps it where the loss reads it.
    from transformers import AutoModelForCausalLM

    tied = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert host_embeddings._shares_head(tied, tied.get_input_embeddings().weight)
    assert not host_embeddings._shares_head(tiny_llama, tiny_llama.get_input_embeddings().weight)


def test_gemma_3s_scaled_table_looked_up_on_the_host_keeps_its_scale():
    """Gemma-3 multiplies its looked-up rows by sqrt(hidden) in the embedding's own forward: the host lookup applies
    the same scale, in the table's dtype, so logits, loss and LoRA gradients are the module's own (untied table, as a
    model whose table would move)."""
    plan = make_plan(Hardware(ram_total_gib=16.0, ram_available_gib=12.0))
    model = load_base_model(str(cached_tiny_model("gemma3_text")), plan, gradient_checkpointing=True)
    model, _, _ = attach_lora(model, rank=4, alpha=8, dropout=0.0, seed=0)
    model.train()
    embedding = model.get_input_embeddings()
    assert float(embedding.embed_scale) == pytest.approx(64 ** 0.5) and host_embeddings.why_not(embedding) == ""
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    logits, loss, grads = _loss_and_grads(model, ids)
    host_embeddings.attach(embedding, torch.device("cpu"))
    try:
        host_logits, host_loss, host_grads = _loss_and_grads(model, ids)
    finally:
        host_embeddings.detach(embedding)
    assert torch.equal(host_logits, logits) and torch.equal(host_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(host_grads[name], grad), name
    assert "_freetune_host_scale" not in embedding.__dict__


def test_an_embedding_with_a_forward_of_its_own_stays_where_it_is():
    class Shifted(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) + 1

    assert "Shifted has a forward of its own" in host_embeddings.why_not(Shifted(10, 4))
    assert host_embeddings.why_not(torch.nn.Embedding(10, 4)) == ""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the table moves from a GPU to the host")
def test_a_table_moved_back_to_the_gpu_with_the_lookup_attached_goes_to_the_host_again():
    """A second train() of the same model: accelerate's prepare moves the model to its GPU, the table (pinned host
    memory) with it, while the host lookup is still attached. to_host puts it on the host again and keeps the lookup;
    the logits stay the module's own throughout."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(cached_tiny_model("llama")), dtype=torch.float16).to("cuda")
    embedding = model.get_input_embeddings()
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0)).to("cuda")
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert host_embeddings.to_host(model) == embedding.weight.numel() * 2
        assert embedding.weight.device.type == "cpu" and embedding.weight.is_pinned()
        assert torch.equal(model(input_ids=ids).logits, want)

        model.to("cuda")  # what the second run's prepare does
        assert embedding.weight.device.type == "cuda" and stashed(embedding, host_embeddings.HOME_ATTR) is not None
        assert host_embeddings.to_host(model) > 0
        assert embedding.weight.device.type == "cpu" and embedding.weight.is_pinned()
        assert embedding.forward.__func__ is host_embeddings._host_forward
        assert torch.equal(model(input_ids=ids).logits, want)

        assert host_embeddings.to_gpu(model) is True and embedding.weight.device.type == "cuda"
        assert "forward" not in embedding.__dict__ and torch.equal(model(input_ids=ids).logits, want)
