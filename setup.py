"""thundersync_verl: zero-staleness streaming RL post-training for verl."""

from setuptools import find_packages, setup

CPU_EXTRAS = [
    "TransferQueue==0.1.11",  # verl's V1 trainer moves batches through it
    "cachetools",  # verl-core extra: ray_trainer imports it
    "uvicorn",  # verl-core extra: rollout utils import it
    "fastapi",  # verl-core extra: rollout utils import it
    "tokenizers",  # trains the tiny model's tokenizer
    "pyarrow",  # parquet datasets
    "matplotlib",  # reward curves and timelines
    "tensorboard",  # metrics backend
    "psutil",
    # Megatron learners on CPU (gloo): megatron-core 0.16.1 is the newest for Python 3.11; verl's
    # engine loads HF weights through mbridge here (megatron-bridge needs Python >= 3.12), and
    # mbridge imports einops without declaring it.
    "megatron-core==0.16.1",
    "mbridge==0.15.1",
    "einops",
]

setup(
    name="thundersync_verl",
    version="0.1.0",
    description="Zero-staleness streaming GRPO/OPD for verl: start each backward as soon as its inputs are fixed",
    # thundersync_harness: the reference code tests and benchmarks share (tests/harness/), kept out
    # of thundersync_verl; the editable install makes it importable from pytest and benchmarks/*.py.
    packages=find_packages(include=["thundersync_verl", "thundersync_verl.*"]) + ["thundersync_harness"],
    package_dir={"thundersync_harness": "tests/harness"},
    # models/shipped/: the tiny student and teacher (safetensors + tokenizer, a few MB), so a first run builds nothing
    # backends/sparse_sync/kernels.cpp: the optional CPU kernels, compiled on first use
    package_data={"thundersync_verl": ["**/*.yaml", "**/*.md", "models/shipped/MANIFEST.json", "models/shipped/*/*",
                                       "backends/sparse_sync/kernels.cpp"]},
    python_requires=">=3.10",
    install_requires=[
        "verl==0.9.1",
        # torch comes with verl; install torch==2.13.0 first on CPU machines (the README does),
        # an open range here would pull a multi-GB CUDA build.
        "numpy",
        "pyyaml",
    ],
    extras_require={
        "cpu": CPU_EXTRAS,
        # pytest-xdist: make test runs the test files on two workers; mkdocs: the docs site (make docs)
        "test": CPU_EXTRAS + ["pytest", "hypothesis", "pytest-timeout", "pytest-xdist==3.8.0",
                              "mkdocs==1.6.1", "mkdocs-material==9.8.2"],
        # The GPU machine's venv (.venv-gpu, made by `bash ci/gpu_check.sh --setup`; never make's CPU .venv):
        # verl's own vllm extra pins the CUDA torch (torch==2.11.0) and vllm==0.24.0; cupy-cu130 is the NCCL
        # transport of ray.util.collective (sparse_sync's push); CPU_EXTRAS bring TransferQueue, megatron-core and
        # mbridge; pytest runs the core buffer tests. TransformerEngine compiles against that torch, so
        # ci/gpu_check.sh installs it after, without build isolation (extra `te`). vllm, sglang, flash-attn and
        # TransformerEngine are imported lazily: the CPU install never needs them.
        "gpu": CPU_EXTRAS + ["verl[vllm,cupy-cu130]==0.9.1", "pytest", "hypothesis"],
        "te": ["transformer-engine[pytorch]"],
        "flash-attn": ["verl[flash-attn-cu130torch211]==0.9.1"],
        "sglang": ["verl[sglang]==0.9.1"],  # its own venv: sglang's pins and vllm's do not mix
    },
    entry_points={
        "verl.plugins": ["thundersync_verl = thundersync_verl.plugin"],
        "console_scripts": ["thundersync = thundersync_verl.cli:main"],
    },
)
