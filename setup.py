"""Install stabledrl_mcore.

CPU (tests, CI, the tiny demo): ``pip install torch==2.13.0 && pip install -e .[test]``.
GPU clusters: install a CUDA build of torch first (any the range takes; 2.13.0 is CI's),
then ``pip install -e .[gpu]`` for Transformer Engine; NVIDIA apex is optional and
built from source (see README).
"""

from setuptools import find_packages, setup

setup(
    name="stabledrl_mcore",
    version="0.1.0",
    description="StableDRL reinforcement learning for diffusion LMs (LLaDA, SDAR) on Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["stabledrl_mcore", "stabledrl_mcore.*"]),
    install_requires=[
        "torch>=2.11,<2.15",  # 2.13.0 is CI's; 2.11.0 and 2.14.1 ran gpu_check --cpu + core tests
        "megatron-core==0.16.1",
        "numpy>=1.26",
        "pyyaml>=6.0",
        "safetensors>=0.4",
        "sentencepiece>=0.2",
        "transformers>=4.53,<6",
        "tokenizers>=0.19",
        "wandb>=0.19",
        "tensorboard>=2.14",  # logging.tensorboard (torch.utils.tensorboard)
        "psutil>=5.9",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "math-verify>=0.7",
        "datasets>=3",
    ],
    extras_require={
        # ruff: `make test` lints and checks the format; peft: tests/test_lora_export.py loads a --peft-out
        # adapter with the real library (0.21.2 works with the transformers 5 of CI)
        "test": ["pytest>=8", "ruff==0.17.6", "peft==0.21.2"],
        # GPU-only: needs CUDA headers to build. apex: see README ("GPU install").
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": ["stabledrl=stabledrl_mcore.cli:main"]},
)
