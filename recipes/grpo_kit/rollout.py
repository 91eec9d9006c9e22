"""Generation for ``recipes/grpo.py``: completions of the round's prompts, behind one small interface, ``Generator``:
``generate(prompt_ids, noise) -> Rollouts``. ``PolicyGenerator`` is the colocated one (``--generation_mode
colocate``): every process generates its share with the policy it trains, one forward per token (``decode``). Another
engine (a vLLM server, a process that only generates) takes the same prompts and noise and returns the same
``Rollouts``, with the generating policy's per-token log-probs where they differ from the trained policy's.

Sampling is this module's own, not transformers': ``NoiseSampler`` samples each token by inverse transform from a
uniform number per completion and position: ``sampling_noise``, drawn from a generator seeded with the seed and the
round. So a completion's sample depends on its
place in the round, not on the process that generates it nor on what ran before: a resumed run samples what the
uninterrupted one did, with no RNG state to save, and 1 or 2 processes sample the same completions (unless a logit
differs in its last bits between batch shapes and a uniform falls exactly there)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from .data import micro_batches
from .loss import add_fixed_logps, completion_tokens, group_advantages
from .rewards import score_round


@dataclass
class Rollouts:
    """Completions of a batch of prompts: each one's token ids (to its first end-of-sequence token, which it keeps, or
    to ``max_completion_length``), whether it was cut there (``truncated``: no end-of-sequence token), and the
    generating policy's log-prob of each token (None: the trained policy generated, so the loss recomputes them)."""

    completion_ids: list[list[int]]
    truncated: list[bool]
    logps: list[list[float]] | None = None


class Generator(Protocol):
    def generate(self, prompt_ids: list[list[int]], noise: torch.Tensor) -> Rollouts:
        """Completions of ``prompt_ids`` (one per row, the prompt repeated for each of its completions), sampled with
        ``noise`` (rows x max_completion_length uniforms, ``sampling_noise``)."""

    def update(self, model) -> None:
        """After each round's optimizer steps (and once before the first round): the trained policy, for a generator
        that does not hold it (``split.SplitLayout`` sends its weights to the generating process)."""


def sampling_noise(seed: int, round_index: int, rows: int, max_completion_length: int) -> torch.Tensor:
    """The uniforms that sample the round's ``rows`` completions (the global batch, every process the same):
    ``torch.rand`` from a generator seeded with ``seed`` and ``round_index``."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + round_index) % 2**63)
    return torch.rand((rows, max_completion_length), generator=generator)


class NoiseSampler(LogitsProcessor):
    """Samples each row's next token from softmax(scores / temperature), after transformers' top-k and top-p filters,
    by inverse transform with its uniform for this position (``noise``), and leaves that token the only one greedy
    search can pick. ``prompt_length``: the padded prompts' length (the position is the tokens generated so far).
    With ``logps``, also keeps each sampled token's log-prob under softmax(scores / temperature) before the filters
    (the distribution the training forward scores: TRL's), one column per position, in ``self.logps``."""

    def __init__(
        self, noise: torch.Tensor, prompt_length: int, temperature: float, top_k: int, top_p: float, logps=False
    ):
        self.noise, self.prompt_length, self.temperature = noise, prompt_length, temperature
        self.filters = [TopKLogitsWarper(top_k)] if top_k else []
        self.filters += [TopPLogitsWarper(top_p)] if top_p < 1 else []
        self.logps = [] if logps else None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        tokens = self.sample(scores, input_ids.shape[1] - self.prompt_length)
        return torch.full_like(scores, -torch.inf).scatter_(1, tokens[:, None], 0.0)

    def sample(self, scores: torch.Tensor, position: int) -> torch.Tensor:
        """Each row's token at completion position ``position`` (0 first), sampled from ``scores`` (rows x
        vocabulary) by its uniform there."""
        scores = unfiltered = scores.float() / self.temperature
        for kept in self.filters:
            scores = kept(None, scores)
        cdf = torch.softmax(scores, dim=-1).cumsum(dim=-1)
        uniform = self.noise[:, position].to(cdf.device)[:, None] * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, uniform.contiguous(), right=True).clamp(max=scores.shape[-1] - 1)
        if self.logps is not None:
            self.logps.append(torch.log_softmax(unfiltered, dim=-1).gather(1, tokens)[:, 0])
        return tokens[:, 0]


class PolicyGenerator:
    """Colocated generation: the policy being trained generates this process's completions, unwrapped from DDP (no
    gradient to sync), in eval mode (no dropout; left in training mode after) and without gradients, with the KV cache,
    prompts padded on the left, until every row has ended or ``max_completion_length`` tokens. Each prompt is read
    once for all its consecutive rows (a group's completions, ``prompt_cache``), not once per row; with LoRA, through
    a merged copy of the adapted weights (``merged_adapter``). Under FSDP2 (``sharded``) every forward gathers each
    block's parameters from all processes, so all of them must run as many forwards: ``decode`` keeps a process whose
    rows have ended stepping (on padding) until every process's have. ``logps``: return the log-prob the policy gave
    each sampled token (the split layout's generating process, whose policy is not the one the trainers score
    with)."""

    def __init__(
        self,
        accelerator,
        model,
        tokenizer,
        *,
        max_completion_length: int,
        temperature: float,
        top_k: int,
        top_p: float,
        sharded: bool,
        logps: bool = False,
    ):
        self.accelerator, self.model, self.tokenizer, self.sharded = accelerator, model, tokenizer, sharded
        self.sampling, self.logps = {"temperature": temperature, "top_k": top_k, "top_p": top_p}, logps
        config = getattr(accelerator.unwrap_model(model), "generation_config", None)
        declared = getattr(config, "eos_token_id", None)
        declared = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
        # Every end-of-sequence id the model declares ends a completion (a chat model's end-of-turn token), and the
        # tokenizer's: TRL's rule.
        self.eos_token_ids = list(dict.fromkeys([tokenizer.eos_token_id, *declared]))
        self.config = GenerationConfig(
            max_new_tokens=max_completion_length,
            do_sample=False,  # NoiseSampler samples; greedy search then takes its token
            eos_token_id=self.eos_token_ids,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            use_cache=True,
        )

    def generate(self, prompt_ids: list[list[int]], noise: torch.Tensor) -> Rollouts:
        unwrapped = self.accelerator.unwrap_model(self.model)
        length, device = max(len(ids) for ids in prompt_ids), self.accelerator.device
        input_ids = torch.full((len(prompt_ids), length), self.tokenizer.pad_token_id)
        attention_mask = torch.zeros((len(prompt_ids), length), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):  # left-padded: every prompt ends where generation starts
            input_ids[row, length - len(ids) :], attention_mask[row, length - len(ids) :] = torch.tensor(ids), 1
        sampler = NoiseSampler(noise, length, **self.sampling, logps=self.logps)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        unwrapped.eval()
        try:
            # LoRA: each adapted weight with its update added, one matmul a layer instead of three (a copy of
            # them while generating; the policy's weights themselves untouched).
            with torch.no_grad(), merged_adapter(unwrapped, sharded=self.sharded):
                cache = prompt_cache(unwrapped, prompt_ids, input_ids, attention_mask)
                completions = decode(
                    unwrapped,
                    input_ids,
                    attention_mask,
                    cache,
                    sampler,
                    max_new_tokens=self.config.max_new_tokens,
                    eos_token_ids=self.eos_token_ids,
                    pad_token_id=self.tokenizer.pad_token_id,
                    synced=self.sharded,
                )
        finally:
            unwrapped.train()  # what follows generation: training
        rollouts = cut_at_end(completions.tolist(), self.eos_token_ids)
        if self.logps:  # each row's, to its end
            logps = torch.stack(sampler.logps, dim=1).tolist()
            rollouts.logps = [row[: len(ids)] for row, ids in zip(logps, rollouts.completion_ids)]
        return rollouts

    def update(self, model) -> None:
        """Nothing: the policy it generates with is the one being trained."""


@contextlib.contextmanager
def merged_adapter(model, *, sharded: bool):
    """Inside the block, a PEFT model's LoRA layers compute ``x (W + B A s)`` with one matmul, as a merged model does:
    each adapted weight's base replaced by a merged copy (``W`` + PEFT's ``get_delta_weight``), the adapters switched
    off; outside it, the base weights are the very tensors they were (PEFT's ``merge_adapter``/``unmerge_adapter``
    would add and subtract the update in place, which leaves them a rounding off each round). The logits equal the
    unmerged model's within float rounding (the sum taken in another order). Nothing changes for a model without
    LoRA, with 4-bit or sharded (FSDP2) base weights, DoRA or several active adapters, or where the copy would not fit
    the device's free memory."""
    from peft.tuners.lora import LoraLayer

    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    adapters = {tuple(layer.active_adapters) for layer in layers}
    if (
        not layers
        or sharded
        or not hasattr(model, "disable_adapter")
        or len(adapters) != 1
        or len(next(iter(adapters))) != 1
        or model.peft_config[next(iter(adapters))[0]].use_dora
        or any(type(layer.get_base_layer().weight) is not torch.nn.Parameter for layer in layers)
        or any(
            layer.get_base_layer().weight.dtype not in (torch.float32, torch.float16, torch.bfloat16)
            for layer in layers
        )
    ):
        yield
        return
    (adapter,) = next(iter(adapters))
    copy_bytes = sum(layer.get_base_layer().weight.nbytes for layer in layers)
    device = layers[0].get_base_layer().weight.device
    if device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < 2 * copy_bytes:
        yield
        return
    bases = [layer.get_base_layer() for layer in layers]
    originals = [base.weight for base in bases]
    try:
        for layer, base, weight in zip(layers, bases, originals):
            merged = weight + layer.get_delta_weight(adapter).to(weight.dtype)
            base.weight = torch.nn.Parameter(merged, requires_grad=False)
        with model.disable_adapter():
            yield
    finally:
        for base, weight in zip(bases, originals):
            base.weight = weight


def prompt_cache(model, prompt_ids: list[list[int]], input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """The KV cache of every row's prompt but its last token, computed once for each run of consecutive rows with the
    same prompt (``num_generations`` completions of a prompt: their keys and values are the same) and copied to each
    of its rows: the prompts' forward costs distinct prompts, not rows. Positions count from each row's first token,
    as ``generate`` counts them from the left-padded ``attention_mask``. None with one-token prompts."""
    if input_ids.shape[1] < 2:
        return None
    starts = [row == 0 or ids != prompt_ids[row - 1] for row, ids in enumerate(prompt_ids)]
    firsts = [row for row, start in enumerate(starts) if start]
    run_of_row = torch.tensor(starts).cumsum(0).sub(1).to(input_ids.device)
    mask = attention_mask[firsts, :-1]
    cache = DynamicCache(config=model.config)
    model(
        input_ids=input_ids[firsts, :-1],
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).masked_fill(mask == 0, 0),  # generate's, from the left padding
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    cache.batch_select_indices(run_of_row)  # each row gets its prompt's keys and values
    return cache


def decode(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache,
    sampler: NoiseSampler,
    *,
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    synced: bool,
) -> torch.Tensor:
    """The completion tokens (rows x at most ``max_new_tokens``; padding after a row's end-of-sequence token) of the
    left-padded prompts ``input_ids``, whose keys and values but the last token's are in ``cache`` (``prompt_cache``;
    None: one-token prompts): one forward per token, each row's next token the one ``sampler`` draws from its logits,
    until every row has ended. What ``generate`` does with greedy search over ``NoiseSampler``'s scores (the same
    forwards, positions and tokens), without its per-token logits processors, stopping criteria and input
    bookkeeping. ``synced`` (FSDP2: every forward gathers each block from every process): every process steps until
    all of them have ended (a collective per token), as ``generate``'s ``synced_gpus``."""
    eos = torch.tensor(eos_token_ids, device=input_ids.device)
    tokens, mask = input_ids[:, -1:], attention_mask
    positions = mask.sum(dim=1, keepdim=True) - 1  # each row's last prompt token, counted from its first
    ended = torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
    generated = []
    for position in range(max_new_tokens):
        logits = model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        tokens = sampler.sample(logits, position).masked_fill(ended, pad_token_id)  # an ended row: padding
        generated.append(tokens)
        ended |= torch.isin(tokens, eos)
        left = (~ended).any().float()
        if synced:  # ended only when every process has
            torch.distributed.all_reduce(left)
        if not left:  # a sync point (on a GPU: waits for the forward)
            break
        tokens, mask, positions = tokens[:, None], torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1), positions + 1
    return torch.stack(generated, dim=1)


def cut_at_end(rows: list[list[int]], eos_token_ids: list[int]) -> Rollouts:
    """Each row to its first end-of-sequence token (kept; what follows is padding), and whether it has none."""
    completions, truncated = [], []
    for ids in rows:
        end = next((index for index, token in enumerate(ids) if token in eos_token_ids), None)
        completions.append(ids if end is None else ids[: end + 1])
        truncated.append(end is None)
    return Rollouts(completions, truncated)


def training_round(
    accelerator,
    generator: Generator,
    prompts: list[dict],
    *,
    round_index: int,
    share: slice,
    num_generations: int,
    seed: int,
    global_batch_size: int,
    max_completion_length: int,
    reward_functions,
    reward_weights: list[float],
    scale_rewards: str,
    tokenizer,
    fmt: str,
    per_device_train_batch_size: int,
    mask_truncated: bool,
    model,
    reference_model,
    temperature: float,
    num_iterations: int,
    beta: float,
    group=None,
    trainer_state=None,
) -> tuple[list[dict], torch.Tensor, dict, torch.Tensor]:
    """This process's part of round ``round_index``: its ``share`` of the round's completions (every prompt
    ``num_generations`` times) generated with its share of the round's noise (split: received from the generating
    process); scored by every reward function and gathered from every process (``group``: the trainers') (a
    collective); each advantage against its group's over the global batch; its rows cut into micro-batches with the
    log-probs that stay fixed over the round (the generating policy's where a later step's ratio needs them and the
    generator did not send them; the reference's with ``beta``). Returns the micro-batches, the gathered rewards and
    lengths (``rewards.score_round``), the advantages (``loss.group_advantages``) and the step's completion tokens
    over every process (the loss's normaliser, counted before the first backward)."""
    rows = [row for row in prompts for _ in range(num_generations)][share]
    noise = sampling_noise(seed, round_index, global_batch_size, max_completion_length)[share]
    completions = generator.generate([row["prompt_ids"] for row in rows], noise)
    gathered = score_round(
        accelerator, reward_functions, rows, completions, tokenizer, fmt, group=group, trainer_state=trainer_state
    )
    advantages = group_advantages(gathered[:, : len(reward_functions)], reward_weights, num_generations, scale_rewards)
    batches = micro_batches(
        rows,
        completions,
        advantages["advantages"][share].cpu(),
        per_device_train_batch_size,
        tokenizer.pad_token_id,
        mask_truncated,
        accelerator.device,
    )
    old = num_iterations > 1 and completions.logps is None
    add_fixed_logps(batches, model, reference_model, temperature, old, reference=beta > 0)
    return batches, gathered, advantages, completion_tokens(gathered, mask_truncated)
