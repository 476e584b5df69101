"""``python -m hl_core.integrations.trl dpo|kto|grpo --config FILE.yaml [--flag value ...]``: TRL's own training
scripts (``trl/scripts/dpo.py``, ``kto.py``, ``grpo.py``) with the humanline trainers.

The command line is TRL's: ``TrlParser`` over the script's arguments (``dataset_name``, ``dataset_train_split``...),
the objective's config (``HumanlineDPOConfig`` and its siblings: TRL's fields and the ``humanline_*`` fields),
``ModelConfig`` (``model_name_or_path``, ``dtype``, the LoRA fields) and ``DatasetMixtureConfig`` (``datasets``: a
list of ``path``, ``data_files``, ``columns``...). A YAML file given with ``--config`` sets any of them; flags after it
override the file. Local models and datasets work as TRL's do; ``random_init: true`` builds the model from its config
with seeded random weights instead of loading them (a smoke test on a folder that holds only a config, such as
``tests/fixtures/tiny/model``). GRPO takes TRL's reward options (``reward_funcs``, ``reward_model_name_or_path``).

One row per update is printed (``update N  loss ...  clipped ...  synced ...``). A bad flag, YAML key or value is one
paragraph naming it and the fix, with exit code 2.
"""

from __future__ import annotations

import copy
import importlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import yaml

from hl_core.errors import UserError, did_you_mean, exit_on_user_error

# Imports inside functions: trl, datasets, transformers and torch load only once the flags are read, so a bad flag
# or a --help answers at once; the trainers and configs import TRL itself.

USAGE = "python -m hl_core.integrations.trl dpo|kto|grpo --config FILE.yaml [--flag value ...]"
OBJECTIVES = ("dpo", "kto", "grpo")
ROW = "update {update}  loss {loss:.8f}  clipped {clipped_frac:.4f}  synced {synced}"


class CliError(UserError):
    """A bad command line or YAML file (one paragraph, exit code 2)."""


def _script_arguments(kind: str):
    """TRL's script arguments for ``kind`` (GRPO's add the reward options), with ``random_init``."""
    from trl import ScriptArguments
    from trl.scripts.grpo import GRPOScriptArguments

    @dataclass
    class HumanlineScriptArguments(GRPOScriptArguments if kind == "grpo" else ScriptArguments):
        random_init: bool = field(
            default=False,
            metadata={"help": "Whether to build the model from its config with random weights (seeded by `seed`) "
                      "instead of loading its weights: a smoke test on a folder that holds only a config."},
        )

    return HumanlineScriptArguments


def _configs():
    from .config import HumanlineDPOConfig, HumanlineGRPOConfig, HumanlineKTOConfig

    return {"dpo": HumanlineDPOConfig, "kto": HumanlineKTOConfig, "grpo": HumanlineGRPOConfig}


def make_parser(kind: str):
    """TRL's parser for ``kind``, whose errors are one paragraph (``CliError``) instead of argparse's usage text."""
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    class Parser(TrlParser):
        def error(self, message):
            raise CliError(f"{message}. Fix: `python -m hl_core.integrations.trl {kind} --help` lists every flag "
                           "(TRL's fields, the `humanline_*` fields, the model's and the datasets').")

    return Parser((_script_arguments(kind), _configs()[kind], ModelConfig, DatasetMixtureConfig),
                  prog=f"python -m hl_core.integrations.trl {kind}")


def _line_of(text: str, key: str) -> int:
    for number, line in enumerate(text.splitlines(), 1):
        if re.match(rf"^{re.escape(key)}\s*:", line):
            return number
    return 1


def check_yaml(parser, path: str) -> None:
    """Refuse, naming ``file:line`` and the fix, a config file that is missing, not a YAML mapping, or that holds a
    key no field of the command has."""
    file = Path(path)
    if not file.is_file():
        raise CliError(f"`--config {path}`: no such file. Fix: give the path of a YAML file (examples/trl_dpo.yaml "
                       "is one).")
    text = file.read_text()
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise CliError(f"`{where}` is not valid YAML ({getattr(exc, 'problem', exc)}). Fix: correct the file; each "
                       "line is `field: value`.") from None
    if not isinstance(config, dict):
        raise CliError(f"`{path}` holds a {type(config).__name__}, not a mapping of fields to values. Fix: write "
                       "one `field: value` per line.")
    known = {action.dest for action in parser._actions} | {"env"}
    for key in config:
        if key not in known:
            raise CliError(f"`{path}:{_line_of(text, str(key))}`: `{key}` is no field of this command."
                           f"{did_you_mean(str(key), known)} Fix: correct or remove it (`--help` lists the fields).")


def parse(argv: List[str]):
    """``(kind, script_args, training_args, model_args, dataset_args)`` from the command line."""
    if not argv or argv[0] not in OBJECTIVES:
        given = f"`{argv[0]}`" if argv else "nothing"
        raise CliError(f"the first argument names the objective, one of {', '.join(OBJECTIVES)}, and it is {given}."
                       f"{did_you_mean(argv[0], OBJECTIVES) if argv else ''} Fix: `{USAGE}`.")
    kind, rest = argv[0], list(argv[1:])
    parser = make_parser(kind)
    known = {action.dest for action in parser._actions} | {"config", "help"}
    for flag in (token.split("=", 1)[0] for token in rest if token.startswith("--")):
        if flag[2:].replace("-", "_") not in known:
            raise CliError(f"`{flag}` is no flag of this command.{did_you_mean(flag[2:], known)} Fix: correct or "
                           f"remove it (`python -m hl_core.integrations.trl {kind} --help` lists the flags).")
    if "--config" in rest:
        at = rest.index("--config")
        if at + 1 >= len(rest):
            raise CliError(f"`--config` needs a file. Fix: `{USAGE}`.")
        check_yaml(parser, rest[at + 1])
    try:
        return (kind, *parser.parse_args_and_config(rest))
    except UserError:
        raise
    except (ValueError, TypeError) as exc:  # TRL's and transformers' checks of a field's value
        raise CliError(f"the {kind} settings are refused: {str(exc).strip()} Fix: correct that field in the YAML "
                       "file or on the command line.") from None


def _dataset(kind: str, script_args, dataset_args):
    """The dataset as TRL's scripts load it: the mixture (``datasets``), else ``dataset_name``."""
    from datasets import load_dataset
    from trl import get_dataset

    if dataset_args.datasets:
        return get_dataset(dataset_args)
    if script_args.dataset_name:
        return load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                            streaming=script_args.dataset_streaming)
    raise CliError(f"no dataset is given. Fix: set `dataset_name` (a Hub id or a local folder of JSON lines) or "
                   f"`datasets` (a list of `path`, `data_files`, `columns`) in the YAML file, e.g. examples/trl_{kind}"
                   ".yaml.")


def _models(kind: str, script_args, training_args, model_args):
    """The policy (a path, as TRL's scripts pass it, or with ``random_init`` a model built from its config) and,
    for DPO and KTO with ``random_init``, its reference (a copy)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = model_args.model_name_or_path
    if not path:
        raise CliError("no model is given. Fix: set `model_name_or_path` (a Hub id or a local folder).")
    training_args.model_init_kwargs = {"revision": model_args.model_revision,
                                       "trust_remote_code": training_args.trust_remote_code,
                                       "attn_implementation": model_args.attn_implementation,
                                       "dtype": model_args.dtype, **(training_args.model_init_kwargs or {})}
    if not script_args.random_init:
        return path, None, None
    torch.manual_seed(training_args.seed)
    dtype = getattr(torch, model_args.dtype) if model_args.dtype not in (None, "auto") else torch.float32
    config = AutoConfig.from_pretrained(path, trust_remote_code=training_args.trust_remote_code)
    policy = AutoModelForCausalLM.from_config(config, dtype=dtype)
    training_args.model_init_kwargs = None  # TRL refuses init kwargs with a model object
    reference = copy.deepcopy(policy) if kind != "grpo" else None
    return policy, reference, AutoTokenizer.from_pretrained(path)


def _reward_functions(script_args) -> list:
    """GRPO's rewards as TRL's script names them: a reward model's path, TRL's functions, or dotted paths."""
    rewards = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    for name in script_args.reward_funcs or ():
        module, _, attribute = name.rpartition(".")
        if not module:
            module = "trl.rewards"
        try:
            function = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as exc:
            raise CliError(f"`reward_funcs: {name}` cannot be loaded ({type(exc).__name__}: {exc}). Fix: name one of "
                           "TRL's reward functions (think_format_reward, accuracy_reward, ...) or a dotted path "
                           "`module.function` importable from the working directory.") from None
        rewards.append(function(max_completion_len=1280, soft_punish_cache=256)
                       if attribute == "get_soft_overlong_punishment" else function)
    if not rewards:
        raise CliError("GRPO needs a reward. Fix: set `reward_model_name_or_path` (e.g. tests/fixtures/tiny/"
                       "reward_model) or `reward_funcs` in the YAML file.")
    return rewards


def run(kind: str, script_args, training_args, model_args, dataset_args) -> int:
    """Train as TRL's script for ``kind`` does, with the humanline trainer; print one row per update."""
    from trl import get_peft_config, get_quantization_config

    from .dpo import HumanlineDPOTrainer
    from .grpo import HumanlineGRPOTrainer
    from .kto import HumanlineKTOTrainer

    dataset = _dataset(kind, script_args, dataset_args)
    model, reference, tokenizer = _models(kind, script_args, training_args, model_args)
    trainer_class = {"dpo": HumanlineDPOTrainer, "kto": HumanlineKTOTrainer, "grpo": HumanlineGRPOTrainer}[kind]
    extra = {"reward_funcs": _reward_functions(script_args)} if kind == "grpo" else {}
    if reference is not None:
        extra["ref_model"] = reference
    trainer = trainer_class(
        model=model, args=training_args, train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        processing_class=tokenizer, peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args), **extra)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if trainer.accelerator.is_main_process:
        for row in trainer.humanline_history:
            print(ROW.format(**row), flush=True)
    trainer.save_model(training_args.output_dir)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return run(*parse(sys.argv[1:] if argv is None else list(argv)))


def entry() -> None:
    """The command: ``main`` with a ``UserError`` turned into one paragraph and exit code 2."""
    exit_on_user_error(main)

