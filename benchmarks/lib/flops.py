"""The two halves of MFU: training FLOPs per token, and the peak FLOP/s of a GPU by name. Plain Python (no torch):
the runner's parent process stays light. The runner computes each LM run's MFU from its tokens/s (``add_flops`` in
run.py); the recipes' results.json carry none of it."""

# Peak dense (no 2:4 sparsity) BF16 tensor-core FLOP/s per GPU, FP32 accumulate, boost clock, from NVIDIA's product
# datasheets (H100/H200: "H100 Tensor Core GPU" and "H200" datasheets, SXM 989.4 TFLOPS, the PCIe/NVL parts lower;
# A100: "A100 Tensor Core GPU" datasheet, 312; L4, L40/L40S: their datasheets, 121 / 181 / 362; RTX 4090/4080: "Ada
# Lovelace architecture" whitepaper, appendix A, 165.2 / 97.5 with FP32 accumulate; RTX 3090: "Ampere GA102"
# whitepaper, 71). MFU is measured against this peak whatever the run's precision. Matched in order against the GPU's
# name as nvidia-smi gives it (torch.cuda.get_device_name() gives the same), so the specific names come first.
PEAK_BF16_FLOPS = [
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # plain "H100 80GB HBM3" is the SXM part
    ("H800 PCIe", 756e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("B200", 2250e12),
    ("B100", 1750e12),
    ("A100", 312e12),
    ("A800", 312e12),  # 40 and 80 GB, SXM and PCIe: the same tensor-core peak
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 6000 Ada", 364e12),
    ("RTX A6000", 155e12),
    ("RTX 4090", 165e12),
    ("RTX 4080", 97e12),
    ("RTX 3090 Ti", 80e12),
    ("RTX 3090", 71e12),
    ("RTX 3080", 60e12),
]


def peak_bf16_flops(gpu_name: str) -> float | None:
    """The table's peak for a GPU name, or None for a GPU it does not know (then no MFU is reported)."""
    return next((flops for key, flops in PEAK_BF16_FLOPS if key.lower() in gpu_name.lower()), None)


def lm_flops_per_token(
    hidden_size: int,
    num_layers: int,
    vocab_size: int,
    num_parameters: int,
    sequence_length: int,
    trained_parameters: int | None = None,
) -> float:
    """Training FLOPs per token of a decoder LM, 6N + 12 L H S (PaLM, Chowdhery et al. 2022, appendix B): N = the
    parameters less the input embedding (a lookup, no multiply-adds; an untied LM head is a matmul and stays in N), 2
    FLOPs per parameter forward and 4 backward; 12 L H S the attention scores and their weighted sum (QK^T and AV),
    over the full S x S square as PaLM counts it (not halved for the causal mask).

    The 4 backward FLOPs are 2 for the gradient of the input and 2 for the gradient of the weight. A frozen weight
    (LoRA's base) still passes the gradient to its input, but has no weight gradient: with ``trained_parameters`` T
    (the adapter, embedding-free), 2N + 2N + 2T = 4N + 2T, not 6N (6N would overstate a LoRA run's MFU by ~1.5x).
    Activation recomputation is not counted (MFU counts the model's FLOPs, not the hardware's)."""
    matmul_parameters = num_parameters - vocab_size * hidden_size
    trained = matmul_parameters if trained_parameters is None else trained_parameters
    return 4 * matmul_parameters + 2 * trained + 12 * num_layers * hidden_size * sequence_length
