"""A value-model checkpoint made from a policy checkpoint: the policy's body plus a seeded value head.

Why: verl's critic loads ``critic.model.path`` as a token-classification model with one label; given a
causal-LM folder, the value head (``score``) is missing from the checkpoint and initialised at random in
every run, so two runs (two modes compared on the same trajectories) start from different critics. Saving
the head once, drawn from ``seed``, gives every run the same critic, as a user's SFT'd value model would.
``python -m thundersync_verl.models.value_model POLICY_DIR OUT_DIR [--seed 0]``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def write_value_model(policy_dir: str | Path, out_dir: str | Path, *, seed: int = 0) -> Path:
    """Save ``policy_dir``'s body with a value head drawn from ``seed`` (and its tokenizer files) to ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    policy_dir, out_dir = Path(policy_dir), Path(out_dir)
    if not (policy_dir / "config.json").is_file():
        raise FileNotFoundError(f"{policy_dir} is not an HF model folder (no config.json): pass the policy checkpoint")
    config = AutoConfig.from_pretrained(policy_dir)
    config.num_labels = 1  # verl's critic: one value per token
    torch.manual_seed(int(seed))  # the head's initialisation, the only part not in the policy checkpoint
    model = AutoModelForTokenClassification.from_pretrained(policy_dir, config=config, torch_dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for f in policy_dir.iterdir():  # the tokenizer travels with the model (verl reads it from the same path)
        if f.is_file() and f.suffix in (".json", ".txt", ".model") and not (out_dir / f.name).exists():
            shutil.copy2(f, out_dir / f.name)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not (Path(args.policy_dir) / "config.json").is_file():
        parser.error(f"{args.policy_dir} is not an HF model folder (no config.json)")
    print(write_value_model(args.policy_dir, args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
