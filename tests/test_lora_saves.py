"""LoRA saves at the adapter's footprint: under FSDP2 the final save gathers the adapter, never the frozen base
(gathered onto rank 0 it is the host RAM the offload config exists to spare, to write an adapter of a few MB)."""

import json
from pathlib import Path

import pytest
from harness.launch import launch_ok


@pytest.mark.slow
def test_the_final_lora_save_under_fsdp_gathers_only_the_adapter(tmp_path):
    launch_ok("fsdp_2gpu.yaml", Path(__file__).parent / "scripts" / "fsdp_gather_adapter.py", tmp_path)
    ranks = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(facts["rank"] for facts in ranks) == [0, 1]
    for facts in ranks:
        adapter, control = facts["trained_only=True"], facts["trained_only=False"]
        # Every rank takes part in the gather (a collective) of the adapter's elements and nothing else.
        assert adapter["gathered"] == facts["trainable"] < 0.2 * facts["total"], facts
        assert control["gathered"] == facts["total"], "the control: accelerator.get_state_dict gathers everything"
        if facts["rank"] == 0:  # what save_pretrained gets: the adapter's weights, by their full names
            assert adapter["keys"] and all(".lora_" in key for key in adapter["keys"]), adapter["keys"][:3]
