"""The one split of the language-model recipes (``train_lm.py``'s device_map, ``pipeline_lm.py``'s stages): whole
decoder blocks, balanced by estimated compute with ``shared.model_split``'s planner, the LM head and loss counted on
the last part; what each part runs."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shared.model_split import find_block_list, lm_head_cost_in_blocks, plan_device_map


def blocks_per_part(plan: dict[str, int], block_list: str) -> list[int]:
    """``{"model.layers.0": 0, ..., "model.layers.6": 1, ...}`` -> ``[5, 2]``: blocks each part runs."""
    prefix = block_list + "."
    parts = [part for name, part in plan.items() if name.startswith(prefix) and name[len(prefix) :].isdigit()]
    return [parts.count(part) for part in range(max(plan.values()) + 1)]


def block_ranges(counts: list[int]) -> list[range]:
    """``[5, 2]`` -> ``[range(0, 5), range(5, 7)]``: the block indices each part owns."""
    starts = [sum(counts[:part]) for part in range(len(counts))]
    return [range(start, start + count) for start, count in zip(starts, counts)]


@dataclass(frozen=True)
class LMSplit:
    """A causal LM's split into parts (stages): ``plan`` (``{module_name: part}``), the ``block_list`` it cuts, the
    blocks each part runs, each part's estimated compute in blocks; the model's parameter count; and a line that says
    so."""

    plan: dict[str, int]
    block_list: str
    blocks_per_stage: list[int]
    stage_costs: list[float]
    num_parameters: int
    description: str

    def facts(self) -> dict:
        """What results.json records of the model and its split."""
        return {
            "model/num_parameters": self.num_parameters,
            "num_stages": len(self.blocks_per_stage),
            "blocks_per_stage": self.blocks_per_stage,
            "stage_cost_share": [cost / sum(self.stage_costs) for cost in self.stage_costs],
        }


def plan_lm_split(model: nn.Module, num_parts: int, sequence_length: int) -> LMSplit:
    """The one plan of both LM recipes for every kind of split (device_map, pipeline stages): whole decoder blocks,
    balanced by estimated compute, with the embeddings on the first part and the final norm + LM head (+ loss, which
    ``lm_head_cost_in_blocks`` counts at ``sequence_length``) on the last. One part: the model unsplit. Call it on
    the whole model, before any split or ``prepare``."""
    block_list = find_block_list(model, set(model._no_split_modules))
    head_cost = lm_head_cost_in_blocks(model, block_list, sequence_length)
    plan = plan_device_map(model, num_parts, last_cost=head_cost)
    counts = blocks_per_part(plan, block_list)
    costs = [count + (head_cost if part == num_parts - 1 else 0) for part, count in enumerate(counts)]
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    size = f"model: {num_parameters / 1e6:.1f}M parameters"
    if num_parts == 1:
        return LMSplit(plan, block_list, counts, costs, num_parameters, f"{size}, {counts[0]} decoder blocks, unsplit")
    parts = [f"blocks {blocks.start}-{blocks.stop - 1}" for blocks in block_ranges(counts)]
    parts[0], parts[-1] = "embeddings + " + parts[0], parts[-1] + " + norm + LM head"
    description = (
        f"{size}; split by estimated compute (the LM head and loss count as {head_cost:.1f} blocks): "
        + "; ".join(
            f"stage {part}: {text} ({cost / sum(costs):.0%})" for part, (text, cost) in enumerate(zip(parts, costs))
        )
    )
    return LMSplit(plan, block_list, counts, costs, num_parameters, description)
