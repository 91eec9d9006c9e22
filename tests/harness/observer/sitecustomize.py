"""A test-only observer: what a launched recipe process really did, seen from outside the recipe.

Python imports ``sitecustomize`` at start-up from the first folder of ``sys.path`` that has one, so every process of a
launch whose environment puts this folder on PYTHONPATH (the launcher, its workers) loads it, with no change to the
recipes. It does nothing unless OBSERVE_DIR is set; then, at exit, each process that ran a script writes
``<script>-rank<RANK>-<pid>.json`` into OBSERVE_DIR (``observed`` in launch.py reads them) with:

- ``opened``: every weights file it opened, through ``safetensors.safe_open`` (what transformers' ``from_pretrained``
  and ``safetensors.torch.load_file`` read with) or ``torch.load``. A process that built its model on the meta device
  opened none.
- ``saved_bytes``/``saved_index_elements``: per backward call, the bytes of the distinct storages autograd saved for
  it (counted by a default ``saved_tensors_hooks`` pair pushed at start-up), and the largest integer tensor among them
  (the token ids the embedding and the loss keep: a count of the tokens in the micro-batch). Non-reentrant activation
  checkpointing pushes hooks of its own around each checkpointed block, and only the innermost pair of hooks applies,
  so what a checkpointed block would have saved never reaches these hooks: the count falls.
- ``bitsandbytes``: calls into bitsandbytes' 4-bit entry points (``quantize_4bit`` at loading, ``matmul_4bit`` in
  every forward of a ``Linear4bit``, ``dequantize_4bit`` in its backward), and for each 4-bit weight a forward used,
  the bytes it is stored in per weight it stands for (0.5: 4 bits).
- ``loading_events``: in order, each ``quantize_4bit`` (``["quantize", weights]``) and each FSDP2 ``fully_shard``
  (``["shard", module class]``) call: how much of the model a process quantized before sharding it.
- ``at_prepare``: per ``Accelerator.prepare`` call, for each model handed to it, its parameters, those on the meta
  device (shape only, no memory behind them) and the bytes of the others: what the process held in memory before
  FSDP2 handed it its shard (low host-RAM loading: a non-main rank holds none of the model there).
- ``before_prepare``: for each parameter of the model given to ``Accelerator.prepare``, as it enters: the shape this
  process holds (a DTensor's local shard) and the whole shape. What a loader left sharded, or whole, until then.
- ``bitsandbytes["matmul_4bit_cpu_packed"]``: forwards of a 4-bit layer whose weight bitsandbytes had repacked into
  its CPU inference layout (``quant_state.packing_format_for_cpu``), which no gradient flows through.

With OBSERVE_AVX512_BF16=1 as well, every ``Linear4bit`` built in the process takes the CPU for one with AVX512-BF16
(bitsandbytes' ``has_avx512bf16`` as that layer's module sees it; its kernels stay those of the real CPU): what makes
it repack its weight in an eval-mode forward without gradients, so that a test sees that path on any CPU.
``bitsandbytes["avx512_bf16_claimed"]`` counts the layers told so.

With OBSERVE_FACTS=1 (launch.py sets it for a launch whose test reads its facts, ``observe=True``; every other
launch runs without this module, as a user's does) and no OBSERVE_DIR, only this is observed: when the
recipe hands its model to ``Accelerator.free_memory`` at the end, each process writes the test-only facts of
``facts.py`` (FSDP2 sharding, device_map hooks, compiled modules, low-RAM shard sums, model-state bytes) to
``<output_dir>.observed/facts-rank<RANK>.json``.

Patches are applied right after the module they patch is imported (a ``sys.meta_path`` finder), before anything else
can bind the originals, and cost one Python call per saved tensor, file open or 4-bit call.
"""

import atexit
import json
import os
import sys
from importlib.machinery import PathFinder

OBSERVE_DIR = os.environ.get("OBSERVE_DIR")
OBSERVE_FACTS = OBSERVE_DIR or os.environ.get("OBSERVE_FACTS") == "1"
record = {
    "opened": [],
    "saved_bytes": [],
    "saved_index_elements": [],
    "bitsandbytes": {},
    "four_bit_bytes_per_weight": {},
    "loading_events": [],
    "at_prepare": [],
    "before_prepare": {},
}
_step = {"storages": {}, "index_elements": 0}


def _note_open(path) -> None:
    if isinstance(path, (str, os.PathLike)):
        record["opened"].append(os.path.realpath(path))


def _count(name: str) -> None:
    record["bitsandbytes"][name] = record["bitsandbytes"].get(name, 0) + 1


# ----------------------------------------------------------------------------- the patches
def patch_safetensors(safetensors) -> None:
    # safetensors.torch (load_file) and transformers bind `safe_open` after this package is imported: they get this.
    original = safetensors.safe_open

    def safe_open(filename, *args, **kwargs):
        _note_open(filename)
        return original(filename, *args, **kwargs)

    safetensors.safe_open = safe_open


def patch_torch(torch) -> None:
    original_load, original_backward = torch.load, torch.autograd.backward

    def load(f, *args, **kwargs):
        _note_open(f)
        return original_load(f, *args, **kwargs)

    def pack(tensor):
        try:
            storage = tensor.untyped_storage()
            key, size = (storage.data_ptr(), tensor.device.type), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage: count its elements
            key, size = id(tensor), tensor.numel() * tensor.element_size()
        _step["storages"][key] = max(size, _step["storages"].get(key, 0))
        if not tensor.is_floating_point() and not tensor.is_complex():
            _step["index_elements"] = max(_step["index_elements"], tensor.numel())
        return tensor.detach()  # not the tensor itself: an output saved for its own grad_fn would make a cycle

    def backward(*args, **kwargs):
        # Everything packed since the last backward call was saved for this one: close the count.
        record["saved_bytes"].append(sum(_step["storages"].values()))
        record["saved_index_elements"].append(_step["index_elements"])
        _step["storages"], _step["index_elements"] = {}, 0
        return original_backward(*args, **kwargs)

    torch.load = load
    torch.autograd.backward = backward  # Tensor.backward (and so accelerator.backward) looks it up at each call
    # A default pair for the whole process (this runs on the main thread, which runs the forwards), never popped.
    torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor).__enter__()


def patch_bitsandbytes(bnb) -> None:
    # Linear4bit.forward calls bnb.matmul_4bit, Params4bit quantizes with bnb.functional.quantize_4bit and the 4-bit
    # matmul's backward dequantizes with F.dequantize_4bit (F is bnb.functional): all looked up at each call.
    functional = bnb.functional
    original_matmul = bnb.matmul_4bit

    def matmul_4bit(A, B, quant_state, *args, **kwargs):
        _count("matmul_4bit")
        if getattr(quant_state, "packing_format_for_cpu", False):
            _count("matmul_4bit_cpu_packed")
        weights = 1
        for size in quant_state.shape:
            weights *= size
        record["four_bit_bytes_per_weight"][str(tuple(quant_state.shape))] = B.numel() * B.element_size() / weights
        return original_matmul(A, B, quant_state, *args, **kwargs)

    bnb.matmul_4bit = matmul_4bit
    for name in ("quantize_4bit", "dequantize_4bit"):
        original = getattr(functional, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            _count(_name)
            if _name == "quantize_4bit":
                record["loading_events"].append(["quantize", args[0].numel()])
            return _original(*args, **kwargs)

        setattr(functional, name, counted)
    if os.environ.get("OBSERVE_AVX512_BF16") == "1":
        # Linear4bit.__init__ looks the name up in its own module: every layer built from now on believes it.
        def has_avx512bf16():
            _count("avx512_bf16_claimed")
            return True

        bnb.nn.modules.has_avx512bf16 = has_avx512bf16


def patch_fsdp(fsdp) -> None:
    # Accelerate and shared/ bind fully_shard from torch.distributed.fsdp after it is imported: they get this.
    original = fsdp.fully_shard

    def fully_shard(module, *args, **kwargs):
        record["loading_events"].append(["shard", type(module).__name__ if not isinstance(module, list) else "list"])
        return original(module, *args, **kwargs)

    fsdp.fully_shard = fully_shard


def patch_accelerate(accelerator_module) -> None:
    # The recipes call accelerator.prepare on an instance: the method is looked up on the class at each call.
    import torch

    accelerator_class = accelerator_module.Accelerator
    original = accelerator_class.prepare

    def prepare(self, *objects, **kwargs):
        for model in [candidate for candidate in objects if isinstance(candidate, torch.nn.Module)][:1]:
            for name, parameter in model.named_parameters():
                local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
                record["before_prepare"][name] = [list(local.shape), list(parameter.shape)]
        models = []
        for candidate in objects:
            if isinstance(candidate, torch.nn.Module):
                parameters = list(candidate.parameters())
                held = [p for p in parameters if p.device.type != "meta"]
                models.append(
                    {
                        "parameters": len(parameters),
                        "meta_parameters": len(parameters) - len(held),
                        "held_bytes": sum(p.numel() * p.element_size() for p in held),
                        "bytes": sum(p.numel() * p.element_size() for p in parameters),
                    }
                )
        record["at_prepare"].append(models)
        return original(self, *objects, **kwargs)

    accelerator_class.prepare = prepare if OBSERVE_DIR else accelerator_class.prepare
    original_free_memory = accelerator_class.free_memory

    def free_memory(self, *objects):
        models = [candidate for candidate in objects if isinstance(candidate, torch.nn.Module)]
        optimizers = [candidate for candidate in objects if isinstance(candidate, torch.optim.Optimizer)]
        if models:
            write_facts(self, models[0], optimizers[0] if optimizers else None)
        return original_free_memory(self, *objects)

    accelerator_class.free_memory = free_memory


def write_facts(accelerator, model, optimizer) -> None:
    """``facts.run_facts`` of this process, to ``<output_dir>.observed/facts-rank<RANK>.json`` (``--output_dir`` of the
    script's own arguments)."""
    from facts import run_facts  # observer/facts.py, beside this file on PYTHONPATH

    argv = sys.argv[1:]
    output_dir = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("--output_dir=")), None)
    if "--output_dir" in argv[:-1]:
        output_dir = argv[argv.index("--output_dir") + 1]
    if output_dir is None:
        return
    folder = output_dir.rstrip("/\\") + ".observed"
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"facts-rank{os.environ.get('RANK', '0')}.json"), "w") as file:
        json.dump(run_facts(accelerator, model, optimizer), file)


PATCHES = {
    "safetensors": patch_safetensors,
    "torch": patch_torch,
    "bitsandbytes": patch_bitsandbytes,
    "torch.distributed.fsdp": patch_fsdp,
    "accelerate.accelerator": patch_accelerate,
}


class PatchAfterImport:
    """Finds the patched modules with the ordinary path finder and patches each right after it has executed."""

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES:
            return None
        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


def write() -> None:
    script = sys.argv[0] if sys.argv else ""  # __main__.__file__ is gone by now
    if not script.endswith(".py"):
        return
    name = f"{os.path.basename(script)}-rank{os.environ.get('RANK', '0')}-{os.getpid()}.json"
    # Read now: a copy of a zygote (tests/harness/zygote.py) runs with its own launch's environment.
    with open(os.path.join(os.environ["OBSERVE_DIR"], name), "w") as file:
        json.dump({"script": os.path.realpath(script), "rank": int(os.environ.get("RANK", "0")), **record}, file)


def forget() -> None:
    """A fork starts with nothing recorded: what its process does is its own (the zygote's imports aside)."""
    for value in record.values():
        value.clear()
    _step["storages"], _step["index_elements"] = {}, 0


if OBSERVE_DIR:
    sys.meta_path.insert(0, PatchAfterImport())
    atexit.register(write)
    os.register_at_fork(after_in_child=forget)
elif OBSERVE_FACTS:
    PATCHES = {"accelerate.accelerator": patch_accelerate}
    sys.meta_path.insert(0, PatchAfterImport())
