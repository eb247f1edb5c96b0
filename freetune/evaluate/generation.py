"""Generating answers to chat prompts for the evaluation: greedy and sampled, from one model, plainly decoded."""

from __future__ import annotations

from dataclasses import dataclass

from freetune.errors import FreetuneError


@dataclass
class Generation:
    prompt_index: int        # which prompt (position in the list given to generate)
    mode: str                # "greedy" or "seed N"
    text: str                # the new text, up to (not including) EOS
    ended_with_eos: bool = True
    new_tokens: int | None = None  # tokens generated, EOS included


# ----------------------------------------------------------------------------------------------- generation

def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def _chat_prompt(tokenizer, messages: list[dict]) -> str:
    if not tokenizer.chat_template:
        raise FreetuneError(
            "The tokenizer has no chat template, so the sanity check cannot build prompts. Use the instruct "
            "model's tokenizer (the one training used), or set tokenizer.chat_template.")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def generate(model, tokenizer, prompts: list[list[dict]], *, greedy: bool = True, seeds=(0, 1, 2),
             temperature: float = 0.7, max_new_tokens: int = 256, batch_size: int = 8) -> list[Generation]:
    """Generate for each chat prompt: once greedy, and once per seed sampling at `temperature`.

    The samples of a batch of prompts come from one call (len(seeds) sequences per prompt, the noise seeded from the
    first seed): decoding costs a step per token whatever the batch, so on a CPU this halved the evaluation's time.

    Decoding is plain on purpose (no top-k/top-p, no repetition penalty, whatever the model's
    generation_config says): the check is about what the weights learnt, and those tricks can hide collapse.
    """
    import torch

    if not prompts:
        raise FreetuneError("No prompts to generate from: give the sanity check at least two rows.")
    eos_ids = _eos_ids(model, tokenizer)
    if not eos_ids:
        raise FreetuneError("Neither the model's generation_config nor the tokenizer names an EOS token, so "
                            "generation could never stop. Set tokenizer.eos_token (e.g. '<|im_end|>').")
    stop = set(eos_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    texts = [_chat_prompt(tokenizer, messages) for messages in prompts]
    modes = ([("greedy", None)] if greedy else []) + [(f"seed {s}", s) for s in seeds]
    if not modes:
        raise FreetuneError("Nothing to generate: set greedy=True or give at least one seed.")
    # (modes, the seed) per call: greedy alone, then every sample at once
    sampled = modes[1:] if greedy else modes
    calls = ([([("greedy", None)], None)] if greedy else []) + ([(sampled, seeds[0])] if seeds else [])

    was_training, padding_side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"  # new tokens must follow each prompt directly
    generations = []
    try:
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                              add_special_tokens=False).to(model.device)
            for call_modes, seed in calls:
                # top_k=0 and top_p=1.0 switch off the model's own sampling filters (Qwen ships top_k=20).
                decoding = (dict(do_sample=False) if seed is None
                            else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                      num_return_sequences=len(call_modes)))
                if seed is not None:
                    torch.manual_seed(seed)  # the same noise for base and adapter
                with torch.no_grad():
                    out = model.generate(**batch, **decoding, repetition_penalty=1.0, max_new_tokens=max_new_tokens,
                                         eos_token_id=eos_ids, pad_token_id=pad_id, use_cache=True)
                # generate returns a prompt's sequences next to each other: prompt i's j-th is row i * n + j
                for k, ids in enumerate(out[:, batch["input_ids"].shape[1]:].tolist()):
                    end = next((t for t, token in enumerate(ids) if token in stop), None)
                    kept = ids if end is None else ids[:end]
                    generations.append(Generation(
                        prompt_index=start + k // len(call_modes), mode=call_modes[k % len(call_modes)][0],
                        text=tokenizer.decode(kept, skip_special_tokens=True),
                        ended_with_eos=end is not None, new_tokens=len(kept) + (end is not None)))
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    order = {mode: k for k, (mode, _) in enumerate(modes)}
    return sorted(generations, key=lambda g: (g.prompt_index, order[g.mode]))
