"""QLoRA under FSDP2 within each card: the 4-bit model is built empty, then loaded one decoder layer at a time and
sharded before the next one is read, so that no GPU (and no host) ever holds the whole model.

``from_pretrained(..., quantization_config=...)`` quantizes the whole model where it loads it: on every GPU of an FSDP
run, before FSDP2 shards it (36 GiB per GPU for a 70B model, which then trains in 24 GiB). Here:

1. ``empty_4bit_model`` (``llm_kit/loading.py``, called by ``load_base_model``): transformers' own 4-bit skeleton
   (its quantizer replaces the linear layers with bitsandbytes' ``Linear4bit``), with no memory behind the weights.
   Each 4-bit weight is a stand-in of its full shape that occupies one element, so PEFT's ``get_peft_model`` builds
   the adapter exactly as on a loaded model (same modules, same random initialisation, on the CPU) and
   ``prepare_model_for_kbit_training`` sets the same dtypes.
2. ``load_4bit_sharded``, after LoRA, before ``accelerator.prepare``: for each decoder layer, the main process reads
   its 16-bit tensors from the safetensors files and broadcasts them (the other processes never open the checkpoint),
   every process quantizes the layer on its device (the same NF4 values everywhere) and ``fully_shard`` keeps this
   process's 1/N of it (on the GPU, or in host RAM under the offload config). Then the next layer.
   Then the embeddings and the final norm with the LM head (not 4-bit; fp32 after ``prepare_model_for_kbit_training``),
   in the FSDP2 units ``prepare`` would make of them, each sharded before its weights are read: every process copies
   its rows of each matrix from the one broadcast (``load_sharded``). ``prepare`` finds them sharded and skips them.

Peak device memory while loading: this process's shards so far, plus one layer in 16-bit and in 4-bit or one matrix
of the embeddings or head in 16-bit (2 GiB at a 128k vocabulary and hidden size 8192), plus every layer's quantization
constants (``absmax``, about 1/64 of a byte per weight, 1 GiB for a 70B model): bitsandbytes keeps them beside the
weight, not in it, so FSDP2, which shards parameters, leaves them whole on every process.
Host RAM per process: one 16-bit tensor being read or received, plus the adapter."""

from __future__ import annotations

import contextlib
import ctypes
import json
import resource
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_module_tensor_to_device
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from shared.model_split import find_block_list
from shared.errors import RecipeError


def checkpoint_files(model_name_or_path: str) -> dict[str, Path]:
    """Which safetensors file holds each tensor: a local folder, or a Hub name (downloaded, when online)."""
    from transformers.utils import cached_file

    try:
        index = cached_file(
            model_name_or_path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False
        )
        if index is not None:
            weight_map = json.loads(Path(index).read_text())["weight_map"]
            files = {name: Path(cached_file(model_name_or_path, name)) for name in set(weight_map.values())}
            return {key: files[name] for key, name in weight_map.items()}
        single = Path(cached_file(model_name_or_path, "model.safetensors"))
    except (OSError, ValueError) as error:
        raise RecipeError(
            f"Could not find the safetensors weights of {model_name_or_path!r}: {error}. QLoRA under "
            "FSDP loads them one layer at a time and reads safetensors only."
        ) from None
    from safetensors import safe_open

    with safe_open(single, "pt") as weights:
        return dict.fromkeys(weights.keys(), single)


def read_or_receive(
    accelerator: Accelerator, files: dict[str, Path], key: str, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """Tensor ``key`` in ``dtype`` on this process's device: read by the main process, broadcast to the others (a
    collective: every process calls it with the same key)."""
    from safetensors import safe_open

    if accelerator.is_main_process:
        if key not in files:
            raise RecipeError(
                f"The checkpoint has no tensor {key!r} (the model built from its config has it): a "
                "checkpoint of another architecture, or one whose names transformers converts at "
                "loading, which this loader does not; use the ddp config for it."
            )
        with safe_open(files[key], "pt") as weights:  # opened per tensor: mapped pages are let go at once
            stored = tuple(weights.get_slice(key).get_shape())
            if stored != tuple(shape):  # else the others would receive it into their shape: scrambled, or a crash
                raise RecipeError(
                    f"The checkpoint's tensor {key!r} has the shape {list(stored)}, but the model built "
                    f"from its config takes {list(shape)} there: a config.json that does not match the "
                    "weights, or a layout this layer-by-layer loader does not convert. If one process "
                    "(single_gpu.yaml) trains it, use accelerate_configs/ddp_2gpu.yaml for 2 GPUs (each "
                    "process loads it with from_pretrained); else correct config.json."
                )
            tensor = weights.get_tensor(key).to(device=accelerator.device, dtype=dtype)
    else:
        tensor = torch.empty(shape, dtype=dtype, device=accelerator.device)
    if accelerator.num_processes > 1:
        torch.distributed.broadcast(tensor, src=0)  # sync point: the others wait for the main process's read
    return tensor


def give_back_freed_host_memory() -> None:
    """Return the host memory freed so far to the OS (glibc's ``malloc_trim``). Without it the peak grows with every
    layer: glibc raises its threshold for serving large blocks from its own heap after each large free, and the freed
    layers stay in that heap (measured on a 1.1B model: +1.2 GiB per process over 22 layers, +0.2 GiB with it)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc (macOS, musl): nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def outer_units(model, tied: bool, reshard_after_forward) -> list[tuple[list[torch.nn.Module], bool | None]]:
    """The FSDP2 units Accelerate's ``fsdp2_prepare_model`` makes of the embeddings (alone, untied) and of the final
    norm and LM head (with the embeddings, tied), with its ``reshard_after_forward``, for ``model`` as ``prepare`` gets
    it. Only units still empty: an adapter on the embeddings or the head is real already, ``prepare`` shards it."""
    from accelerate.utils.fsdp_utils import _find_final_norm  # Accelerate's own choice of the norm to group

    embeddings, head, norm = model.get_input_embeddings(), model.get_output_embeddings(), _find_final_norm(model)
    units = [] if tied or embeddings is None else [([embeddings], reshard_after_forward)]
    tail = [module for module in ((norm, embeddings, head) if tied else (norm, head)) if module is not None]
    units += [(tail, False)] if tail else []  # kept gathered from the end of forward to the start of backward
    return [
        (modules, reshard)
        for modules, reshard in units
        if all(parameter.is_meta for module in modules for parameter in module.parameters())
    ]


def load_sharded(
    accelerator: Accelerator,
    files: dict[str, Path],
    base,
    modules: list,
    tied: bool,
    dtype: torch.dtype,
    shard_kwargs: dict,
) -> None:
    """Shard one empty FSDP2 unit first, then fill this process's rows of each weight from the main process's read,
    in the skeleton's dtype (fp32 after ``prepare_model_for_kbit_training``): in flight is one 16-bit matrix, never
    the whole fp32 one (at a 128k vocabulary and hidden size 8192, 2 GiB instead of 6)."""
    names = {id(module): name for name, module in base.named_modules()}
    fully_shard(modules if len(modules) > 1 else modules[0], **shard_kwargs)  # on meta: no memory yet
    offloaded = isinstance(shard_kwargs["offload_policy"], CPUOffloadPolicy)
    for module in modules:
        buffers = dict(module.named_buffers())  # real already (an embedding scale): to_empty would wipe them
        module.to_empty(device=torch.device("cpu") if offloaded else accelerator.device)  # FSDP2 re-pads the shards
        for name, buffer in buffers.items():
            set_module_tensor_to_device(module, name, buffer.device, value=buffer)
    if tied:
        base.tie_weights()  # to_empty gave the head a matrix of its own
    parameters = {id(p): (names[id(m)], n, p) for m in reversed(modules) for n, p in m.named_parameters()}
    for prefix, name, parameter in parameters.values():  # tied: the matrix once, under the embeddings' name
        full = read_or_receive(accelerator, files, f"{prefix}.{name}", tuple(parameter.shape), dtype)
        rows = -(-parameter.shape[0] // accelerator.num_processes)  # FSDP2's Shard(0) splits as torch.chunk does
        local = parameter.to_local()
        with torch.no_grad():
            local.copy_(full[accelerator.process_index * rows :][: local.shape[0]])


def load_4bit_sharded(accelerator: Accelerator, model, model_name_or_path: str) -> None:
    """Load the weights of an ``empty_4bit_model`` (LoRA applied or not; ``llm_kit.loading``) one decoder layer at a
    time, each layer quantized on this process's device and sharded by FSDP2 before the next is read; then the
    embeddings, final norm and LM head, sharded as they load. Call it on every process after LoRA and before
    ``accelerator.prepare``, which skips what is sharded already and shards the rest (an adapter on the embeddings,
    position embeddings), and after ``shared.fsdp.set_keep_gathered_in_one_process`` (its resharding policy is the
    one each unit gets here)."""
    import bitsandbytes as bnb
    from transformers.pytorch_utils import Conv1D

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dtype = base.hf_quantizer.quantization_config.bnb_4bit_compute_dtype  # what from_pretrained would load in
    block_list = find_block_list(base, set(base._no_split_modules))  # e.g. model.layers
    files = checkpoint_files(model_name_or_path) if accelerator.is_main_process else {}
    plugin = accelerator.state.fsdp_plugin
    # The arguments Accelerate's own FSDP2 preparation gives every unit (accelerate.utils.fsdp_utils).
    shard_kwargs = {
        "reshard_after_forward": plugin.reshard_after_forward,
        "offload_policy": plugin.cpu_offload,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
    }
    # Accelerate's low-RAM path would move the loaded shards to meta and broadcast rank 0's full state: done here.
    # (The recipe turns FSDP_CPU_RAM_EFFICIENT_LOADING off too, for transformers, in its main().)
    plugin.cpu_ram_efficient_loading = False

    tied = base.all_tied_weights_keys  # e.g. lm_head.weight -> the embedding's: not read, tied to it once loaded

    def load(module: torch.nn.Module, prefix: str) -> None:
        for name, param in list(module.named_parameters()):
            owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            key = (prefix + name).replace(".base_layer.", ".")  # PEFT wraps the linear layers it adapts
            if "lora_" in name or key in tied:  # the adapter is real already (PEFT built it on the CPU); tied below
                continue
            if isinstance(owner, bnb.nn.Linear4bit) and name.endswith("weight"):
                # A Conv1D (GPT-2) stores [in, out]: transposed, then quantized where it lands, as from_pretrained does
                # (transformers' Bnb4bitQuantize; Params4bit.to() runs bitsandbytes' quantize_4bit).
                conv1d = issubclass(getattr(owner, "source_cls", torch.nn.Linear), Conv1D)
                shape = (owner.in_features, owner.out_features) if conv1d else (owner.out_features, owner.in_features)
                value = read_or_receive(accelerator, files, key, shape, dtype)
                value = value.T if conv1d else value
                owner.weight = bnb.nn.Params4bit(value, requires_grad=False, **param.__dict__).to(value.device)
            else:
                # Read in the load dtype (rounded as from_pretrained rounds), then the skeleton's own (fp32 after
                # prepare_model_for_kbit_training). To value.device: Accelerate's CPU device, cpu:0, would make .to()
                # copy the Parameter into a plain tensor, which tie_weights does not take for a parameter.
                value = read_or_receive(accelerator, files, key, tuple(param.shape), dtype).to(param.dtype)
                set_module_tensor_to_device(module, name, value.device, value=value)

    blocks = base.get_submodule(block_list)
    for index, block in enumerate(blocks):
        load(block, f"{block_list}.{index}.")
        if accelerator.is_fsdp2:
            fully_shard(block, **shard_kwargs)  # keeps this process's 1/N; the full layer is freed
        give_back_freed_host_memory()
    if tied:
        base.tie_weights()  # one matrix for the embeddings and the head before FSDP2 groups them
    units = outer_units(model, bool(tied), shard_kwargs["reshard_after_forward"]) if accelerator.is_fsdp2 else []
    for modules, reshard in units:
        load_sharded(
            accelerator, files, base, modules, bool(tied), dtype, {**shard_kwargs, "reshard_after_forward": reshard}
        )
    in_units = {id(module) for modules, _ in units for module in modules}
    for name, module in base.named_children():  # the rest (e.g. position embeddings), whole: the root shards it
        if id(module) in in_units or not any(True for _ in module.named_parameters()):
            continue
        if name == block_list.split(".")[0]:  # the holder of the layers: its other parameters (the final norm)
            holder = base.get_submodule(name)
            for child_name, child in holder.named_children():
                if f"{name}.{child_name}" != block_list and id(child) not in in_units:
                    load(child, f"{name}.{child_name}.")
        else:
            load(module, f"{name}.")
    if tied and not units:  # e.g. the LM head is the embedding matrix: tied again to the loaded one
        base.tie_weights()
    # What this process holds now (its shards, on the device or, offloaded, in host RAM), the quantization constants
    # beside them, and its host RAM peak so far: said once, by the main process.
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    accelerator.print(
        f"QLoRA loaded one layer at a time ({len(blocks)} layers): this process holds "
        f"{held / 2**30:.2f} GiB of weights (1/{accelerator.num_processes} of each) and every layer's "
        f"quantization constants; host RAM peak so far {peak:.2f} GiB per process"
    )
