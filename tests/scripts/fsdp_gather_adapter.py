"""LoRA under FSDP2 (2 processes): what the final save gathers. Counts, per rank, the elements every DTensor
redistribution to a full replica moved (how torch's state-dict gather works), for shared.fsdp.gathered_state_dict with
trained_only (the adapter) and, as the control, without (the whole model). Each rank writes its facts to
``OUTPUT_DIR/rank<r>.json`` (printed lines of two ranks can run together):
``python fsdp_gather_adapter.py OUTPUT_DIR``."""

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Replicate

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.fsdp import gathered_state_dict, set_keep_gathered_in_one_process, set_wrap_at_blocks
from shared.accelerator import build_accelerator
from shared.fsdp import set_fsdp_on_cpu

gathered = []
redistribute = DTensor.redistribute


def counting_redistribute(self, device_mesh=None, placements=None, **kwargs):
    if placements is not None and all(isinstance(placement, Replicate) for placement in placements):
        gathered.append(self.numel())
    return redistribute(self, device_mesh, placements, **kwargs)


DTensor.redistribute = counting_redistribute
accelerator = build_accelerator(dist_timeout=60)
set_fsdp_on_cpu(accelerator)  # CPU + FSDP config: Accelerate's state set back to FSDP2
set_keep_gathered_in_one_process(accelerator)
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

torch.manual_seed(0)
config = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=128,
    tie_word_embeddings=False,
)
model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules="all-linear"))
trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
total = sum(p.numel() for p in model.parameters())
set_wrap_at_blocks(accelerator, model, "base_model.model.model.layers")
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
model, optimizer = accelerator.prepare(model, optimizer)
facts = {"rank": accelerator.process_index, "trainable": trainable, "total": total}
for trained_only in (True, False):
    gathered.clear()
    state_dict = gathered_state_dict(accelerator, model, trained_only=trained_only)
    facts[f"trained_only={trained_only}"] = {"gathered": sum(gathered), "keys": sorted(state_dict)}
Path(sys.argv[1], f"rank{accelerator.process_index}.json").write_text(json.dumps(facts))
accelerator.wait_for_everyone()
accelerator.end_training()
