"""Measure what a decoder block keeps for backward, per method, and set it beside the fit planner's count.

    python tools/activation_probe.py                      # full, LoRA, QLoRA x bf16 autocast, fp32; no dropout
    python tools/activation_probe.py --lora_dropout 0.05 --json

A small random Llama (hidden 256, MLP 688, 8 heads) is built the way recipes/llm_finetune.py builds its model (full:
fp32 weights; LoRA: the base in the compute dtype, PEFT's "all-linear" adapter; QLoRA: bitsandbytes NF4 with double
quantization, prepare_model_for_kbit_training), one forward runs on the CPU (under bf16 autocast for bf16), and every
tensor autograd saves for backward is counted once by its storage (``torch.autograd.graph.saved_tensors_hooks``),
parameters excluded. Two depths (2 and 6 blocks) are measured and differenced, so what is left is one block's bytes,
printed per token per hidden unit (bytes / (s x b x h)) next to the fit planner's ``block_activation_bytes``
(``tools/planner/memory.py``; plus, under autocast, the 16-bit weight copies that autocast keeps, which the planner
counts as temporaries) and the checkpointed block's input. On the CPU, dropout keeps its mask in the activations'
dtype (CUDA's fused dropout keeps 1 byte), so compare with ``--lora_dropout 0`` (the default here). The numbers
``tests/test_plan.py`` checks the planner against come from this script.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.planner import block_activation_bytes, precision_profile, shape_from_config

HIDDEN, MLP, HEADS, VOCAB, SEQ_LEN, BATCH = 256, 688, 8, 1000, 64, 2


def _config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def saved_bytes(folder: Path, method: str, mixed_precision: str, lora_dropout: float, checkpointing: bool) -> int:
    """Bytes of the distinct tensors (not parameters) autograd saves in one forward of the model in ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    compute = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    quantization = None
    if method == "qlora":
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute,
            bnb_4bit_quant_storage=compute,
        )
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=torch.float32 if method == "full" else compute,
        quantization_config=quantization,
        device_map={"": "cpu"} if quantization else None,
    )
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if method != "full":
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if method == "qlora":
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # (on already: above)
        adapter = LoraConfig(r=8, lora_alpha=16, lora_dropout=lora_dropout, target_modules="all-linear")
        model = get_peft_model(model, adapter)
    model.train()
    parameters = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters and storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed_precision == "bf16"):
            model(input_ids=ids, labels=ids)
    return sum(seen.values())


def probe(method: str, mixed_precision: str, lora_dropout: float, folders: dict) -> dict:
    unit = SEQ_LEN * BATCH * HIDDEN
    measured = {}
    for checkpointing in (False, True):
        low, high = (saved_bytes(folders[n], method, mixed_precision, lora_dropout, checkpointing) for n in (2, 6))
        measured[checkpointing] = (high - low) / 4 / unit
    shape = shape_from_config(_config(2), name="probe")
    profile = precision_profile(method, mixed_precision)
    planner = block_activation_bytes(
        shape, SEQ_LEN, BATCH, mixed_precision, method=method, profile=profile, lora_dropout=lora_dropout
    )
    copies = 2 * shape.block_linear_params if method == "full" and profile["weight_copies"] else 0
    return {
        "method": method,
        "mixed_precision": mixed_precision,
        "lora_dropout": lora_dropout,
        "measured_per_block": round(measured[False], 2),
        "planner_per_block": round((planner + copies) / unit, 2),
        "measured_checkpointed_per_block": round(measured[True], 2),
        "planner_checkpointed_per_block": profile["residual"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lora_dropout", type=float, default=0.0, help="LoRA dropout (default 0: see above).")
    parser.add_argument("--json", action="store_true", help="Print the rows as JSON.")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for layers in (2, 6):
            folders[layers] = Path(tmp) / f"llama{layers}"
            AutoModelForCausalLM.from_config(_config(layers)).save_pretrained(folders[layers])
        rows = [
            probe(method, mixed_precision, args.lora_dropout, folders)
            for method in ("full", "lora", "qlora")
            for mixed_precision in ("bf16", "no")
        ]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print("bytes per token per hidden unit, one block   measured  planner   checkpointed: measured  planner")
        for row in rows:
            print(
                f"{row['method']:<6} mixed_precision={row['mixed_precision']:<4}              "
                f"{row['measured_per_block']:>8.2f} {row['planner_per_block']:>8.2f}"
                f"{row['measured_checkpointed_per_block']:>24.2f} {row['planner_checkpointed_per_block']:>8}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
